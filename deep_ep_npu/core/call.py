"""What an expert-parallel call is: one frozen type per layout on a small shared base (:class:`Call`), a fused call's
expert FFN (:class:`FFN`) and where the experts live (:class:`Experts`). Plain data: every front-end maps its own
arguments onto one of these (field names are torch_npu's; ``names`` maps them back for errors), :mod:`.rules` checks
and normalizes them (ids int64, -1 where a mask excludes a pair), a backend runs them; the call's type picks its
layout. Dispatches: :class:`MaskedDispatch` (DeepEP low-latency ``recv_x`` `[L, R * N, H]`), :class:`FlatDispatch`
(Ascend's ``expand_x`` `[A, H]`), :class:`ExpandDispatch` (DeepEP V2's and normal mode's rows), :class:`FusedCall`
(MegaMoE); combines: :class:`MaskedCombine`, :class:`FlatCombine`, :class:`ExpandCombine`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from ..handle import EPHandle, LowLatencyHandle
from ..quant import Quant

if TYPE_CHECKING:
    from ..transports.group import EPGroup


@dataclasses.dataclass(frozen=True)
class Experts:
    """Where experts live (:func:`.ascend.experts`, :func:`.rules.plain_experts`). Ranks are addressed by their
    *logical* rank: the EP rank itself, or with ``elastic_info`` the rank in the scaled-down EP (``Table1[ep_rank]``,
    -1 for ranks that take no part). Logical ranks ``[0, SR)`` host shared experts, the rest ``num_local`` routed
    experts each; ``ep_rank_of[logical]`` is the EP rank; ids from ``num_moe_experts`` on: zero, copy, const experts."""

    world_size: int  # W: ranks of the EP group
    rank: int
    num_moe_experts: int  # E in the active layout (elastic: new_moe_expert_count)
    num_local: int  # L: routed experts per MoE rank
    num_local_here: int  # experts on this rank (1 on a shared-expert rank)
    logical_world_size: int  # W' (== W without elastic_info)
    logical_rank: int  # -1: this rank takes no part (elastic)
    ep_rank_of: tuple[int, ...]  # logical rank -> EP rank
    shared_expert_rank_num: int = 0  # SR in the active layout
    shared_expert_num: int = 0  # effective S (0 when SR == 0)
    zero_expert_num: int = 0
    copy_expert_num: int = 0
    const_expert_num: int = 0
    tp_world_size: int = 0
    tp_rank_id: int = 0
    tp: EPGroup | None = None  # the TP pair's group (tp_world_size 2)
    scales_experts: int = 0  # moe_expert_num as given (rows of smooth scales after the shared ones)
    platform: str | None = None  # strict's platform: None, "a3" or "a5"
    plain: bool = True  # routed experts only, EP rank = id // L (no shared-expert ranks, no elastic re-layout)
    scales_shared: int = 0  # shared_expert_num as passed - S: leading smooth-scale rows also accepted, unused


@dataclasses.dataclass(frozen=True)
class Call:
    """What every call has: its front-end's ``op`` name, T tokens ``x`` `[T, H]` (a combine: the expert outputs in its
    layout) and ``expert_ids`` `[T, K]` (validated: int64, -1 = no expert or excluded by a mask), the ``experts``;
    keyword-only: ``expert_scales`` `[T, K]` fp32 top-k weights (or None) and ``names`` (the front-end's names of the
    fields, for errors)."""

    op: str
    x: torch.Tensor
    expert_ids: torch.Tensor
    experts: Experts
    _: dataclasses.KW_ONLY
    expert_scales: torch.Tensor | None = None
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MaskedDispatch(Call):
    """DeepEP's low-latency dispatch into ``recv_x`` `[L, R * N, H]`, N = ``num_max``: ``quant`` None or a
    :class:`~deep_ep_npu.quant.Quant` (DeepEP's fp8 or int8 per token); ``recv_stats`` `[L]` int32 gets the received
    rows per local expert added, ``wait_stats`` `[R]` int64 the wait in ns; ``expert_scales`` are checked only."""

    _: dataclasses.KW_ONLY
    num_max: int
    quant: Quant | None = None
    recv_stats: torch.Tensor | None = None
    wait_stats: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class FlatCall(Call):
    """What the Ascend ops' flat calls add: ``x_active_mask`` `[T]` (a prefix) or `[T, K]` bool, ``global_bs``,
    ``comm_alg`` and ``wait_stats`` (``performance_info`` `[W]` int64 µs)."""

    _: dataclasses.KW_ONLY
    x_active_mask: torch.Tensor | None = None
    global_bs: int = 0
    comm_alg: str = ""
    wait_stats: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class FlatDispatch(FlatCall):
    """Ascend's dispatch into ``expand_x`` `[A, H]`: ``expert_scales`` travel with the rows; ``quant`` None or a
    :class:`~deep_ep_npu.quant.Quant` (:func:`.platforms.dispatch_quant`), ``scales`` `[S + E, H]` fp32 smooth
    scales; ``expert_token_nums_type`` 1 counts, 0 cumsum; ``ccl_buffer_size`` MB or None; set by the rules:
    ``num_max`` (global_bs / W) and ``capacity`` A."""

    _: dataclasses.KW_ONLY
    quant: Quant | None = None
    scales: torch.Tensor | None = None
    expert_token_nums_type: int = 1
    ccl_buffer_size: int | None = None
    num_max: int = 0
    capacity: int = 0


@dataclasses.dataclass(frozen=True)
class ExpandDispatch(Call):
    """DeepEP V2's (and normal mode's) dispatch into rows, N = ``num_max``: ``x_sf`` (pre-quantized scale factors
    `[T, S]`), ``recv_stats`` `[L]` int32 (added to), ``alignment``, ``do_expand``, ``zero_padding``, ``tma_sf``,
    ``cpu_sync``, ``cached`` (a handle whose layout is reused), ``handle_copy``, ``recv_rows`` (the non-expand rows to
    allocate at the send when known there, e.g. DeepEP normal mode's exact count or its ``num_worst_tokens``; 0:
    ``cpu_sync`` decides), ``recv_from`` (the non-expand rows each source sends here when known at the send, as after
    DeepEP normal mode's count round: the own rows then go straight to their place)."""

    _: dataclasses.KW_ONLY
    num_max: int
    x_sf: torch.Tensor | None = None
    recv_stats: torch.Tensor | None = None
    alignment: int = 1
    do_expand: bool = False
    zero_padding: bool = False
    tma_sf: bool = False
    cpu_sync: bool = True
    cached: EPHandle | None = None
    handle_copy: bool = True
    recv_rows: int = 0
    recv_from: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class FusedCall(Call):
    """A fused MegaMoE call's tokens (its FFN: :class:`FFN`): N = ``num_max`` tokens per rank at most,
    ``x_active_mask`` `[T]` bool (a prefix) or None, ``expert_scales`` the top-k weights."""

    _: dataclasses.KW_ONLY
    expert_scales: torch.Tensor  # (required)
    num_max: int
    x_active_mask: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class MaskedCombine(Call):
    """DeepEP's low-latency combine: ``x`` `[L, R * N, H]` (with ``zero_copy`` the Buffer's combine buffer is read
    instead), ``handle`` the dispatch's, ``expert_ids`` as at dispatch, ``expert_scales`` the weights; ``logfmt``:
    DeepEP's LogFMT-10 rows on the wire; ``out`` `[T, H]` or None; ``wait_stats`` `[R]` int64 ns; ``slot_order``: rows
    are summed per token in slot order (k ascending), so the result does not depend on which rank holds an expert
    (replicas, :mod:`deep_ep_npu.eplb`)."""

    handle: LowLatencyHandle
    _: dataclasses.KW_ONLY
    expert_scales: torch.Tensor  # (required)
    logfmt: bool = False
    zero_copy: bool = False
    out: torch.Tensor | None = None
    wait_stats: torch.Tensor | None = None
    slot_order: bool = False


@dataclasses.dataclass(frozen=True)
class FlatCombine(FlatCall):
    """Ascend's combine: ``x`` `[A, H]`, ``handle`` ``(assist_info_for_combine, ep_send_counts, tp_send_counts)``,
    ``expert_ids`` and ``x_active_mask`` as at dispatch, ``expert_scales`` weights applied at the source;
    ``shared_expert_x`` `[T, H]` added with weight 1; ``ori_x`` / ``const_expert_*``: the copy / const experts'
    inputs; ``comm_quant_mode``: the rows' wire format (0, 2 int8 per 8, 3 / 4 MX fp8); ``out`` `[T, H]` or None;
    ``num_rows`` own rows of ``x`` (then ``num_peer`` TP peer rows; -1: not read, the value checks were off)."""

    handle: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    _: dataclasses.KW_ONLY
    expert_scales: torch.Tensor  # (required)
    shared_expert_x: torch.Tensor | None = None
    ori_x: torch.Tensor | None = None
    const_expert_alpha_1: torch.Tensor | None = None
    const_expert_alpha_2: torch.Tensor | None = None
    const_expert_v: torch.Tensor | None = None
    comm_quant_mode: int = 0
    out: torch.Tensor | None = None
    num_rows: int = 0
    num_peer: int = 0


@dataclasses.dataclass(frozen=True)
class ExpandCombine(Call):
    """DeepEP V2's (and normal mode's) combine: ``x`` `[rows, H]`, ``handle`` the dispatch's, ``expert_scales`` the
    weights sent back (None: rows come back pre-weighted); ``bias`` up to two `[T, H]` tensors added first;
    without ``multiple_reduction`` every expand row goes back as it is; ``by_rank`` sums each token's rows by source
    rank ascending (else by last top-k slot), ``raw_weights`` returns ``expert_scales`` rows as given (else 0 where
    the slot's expert is not on that rank)."""

    handle: EPHandle
    _: dataclasses.KW_ONLY
    bias: tuple[torch.Tensor, ...] = ()
    multiple_reduction: bool = True
    by_rank: bool = False
    raw_weights: bool = False


DispatchCall = MaskedDispatch | FlatDispatch | ExpandDispatch
CombineCall = MaskedCombine | FlatCombine | ExpandCombine


@dataclasses.dataclass(frozen=True)
class FFN:
    """The expert FFN of a fused call (GMM1 -> SwiGLU -> GMM2), E_local experts, K = hidden, 2N = GMM1's columns
    (gate, then up): ``w1`` `[E_local, K, 2N]`, ``w2`` `[E_local, N, K]` (int8 with ``w1_scale`` `[E_local, 2N]` /
    ``w2_scale`` `[E_local, K]` fp32 per-channel scales, else float), the output dtype, the SwiGLU clamp (0: none; or
    CANN's activation, `[rows, 2N]` fp32 -> `[rows, N]` fp32), the pipeline's segments (``segment_by`` ``"expert"`` or
    ``"token"``) and the fused op's routed-row workspace ``max_output_size``; None: the rules' defaults."""

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    swiglu_limit: float | Callable[[torch.Tensor], torch.Tensor] | None = None
    num_segments: int | None = None
    segment_by: str = "expert"
    max_output_size: int | None = None
