"""The one description of an expert-parallel call: :class:`DispatchCall`, :class:`CombineCall`, a fused call's expert
FFN (:class:`FFN`) and where the experts live (:class:`Experts`). Plain data: every front-end maps its own arguments
onto these (field names are torch_npu's; ``names`` maps them back for errors), :mod:`.rules` checks and normalizes
them (ids int64, -1 where a mask excludes a pair), a backend runs them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..quant import Quant


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
    tp: Any = None  # the TP pair's EPGroup (tp_world_size 2)
    scales_experts: int = 0  # moe_expert_num as given (rows of smooth scales after the shared ones)
    platform: str | None = None  # strict's platform: None, "a3" or "a5"
    plain: bool = True  # routed experts only, EP rank = id // L (no shared-expert ranks, no elastic re-layout)
    scales_shared: int = 0  # shared_expert_num as passed - S: leading smooth-scale rows also accepted, unused


@dataclasses.dataclass
class Call:
    """What every call has: its front-end's ``op`` name, the ``layout`` (``"masked"``, ``"flat"`` or ``"expand"``), T
    tokens ``x`` `[T, H]` and ``expert_ids`` `[T, K]` (validated: int64, -1 = no expert or excluded by the mask), the
    ``experts``; keyword-only: the ``x_active_mask`` `[T]` (a prefix) or `[T, K]` bool, ``expert_scales`` `[T, K]`
    fp32 top-k weights, ``wait_stats`` (masked: `[R]` int64 ns, flat: ``performance_info`` `[W]` int64 µs), the flat
    layout's ``global_bs`` and ``comm_alg``, and ``names`` (the front-end's names of the fields, for errors)."""

    op: str
    layout: str
    x: Any
    expert_ids: Any
    experts: Experts
    _: dataclasses.KW_ONLY
    x_active_mask: Any = None
    expert_scales: Any = None
    wait_stats: Any = None
    global_bs: int = 0
    comm_alg: str = ""
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DispatchCall(Call):
    """One dispatch into ``layout``: ``"masked"`` (DeepEP's ``recv_x`` `[L, R * N, H]`), ``"flat"`` (Ascend's
    ``expand_x`` `[A, H]`) or ``"expand"`` (DeepEP V2's rows); N = ``num_max``. ``expert_scales`` travel with the rows;
    ``quant``: None, DeepEP's ``"fp8_e4m3"`` (``round_scale`` / ``use_ue8m0`` as DeepEP's) or a
    :class:`~deep_ep_npu.quant.Quant`; ``scales`` `[S + E, H]` fp32 smooth scales; ``recv_stats`` `[L]` int32 gets
    the received rows per local expert added. Flat: ``capacity`` A (set by the rules). The ``expand`` layout's
    fields: ``x_sf`` (pre-quantized scale factors `[T, S]`), ``alignment``, ``do_expand``, ``zero_padding``,
    ``tma_sf``, ``cpu_sync``, ``cached`` (a handle whose layout is reused), ``handle_copy``, ``recv_rows`` (the
    non-expand rows to allocate at the send when known there, e.g. DeepEP normal mode's exact count or its
    ``num_worst_tokens``; 0: ``cpu_sync`` decides), ``recv_from`` (the non-expand rows each source sends here when
    known at the send, as after DeepEP normal mode's count round: the own rows then go straight to their place)."""

    num_max: int = 0
    quant: Quant | None = None
    scales: Any = None
    recv_stats: Any = None
    expert_token_nums_type: int = 1
    ccl_buffer_size: int | None = None
    capacity: int = 0
    x_sf: Any = None
    alignment: int = 1
    do_expand: bool = False
    zero_padding: bool = False
    tma_sf: bool = False
    cpu_sync: bool = True
    cached: Any = None
    handle_copy: bool = True
    recv_rows: int = 0
    recv_from: tuple[int, ...] = ()


@dataclasses.dataclass
class CombineCall(Call):
    """One combine: ``x`` the expert outputs in the dispatch's layout (masked `[L, R * N, H]`, flat `[A, H]`, expand
    `[rows, H]`), ``handle`` the dispatch's, ``expert_ids`` and ``x_active_mask`` as at dispatch, ``expert_scales``
    weights applied at the source (None: rows come back pre-weighted); ``shared_expert_x`` `[T, H]` added with weight
    1 (expand: a tuple of up to two biases); ``ori_x`` / ``const_expert_*``: the copy / const experts' inputs;
    ``comm_quant_mode``: the rows' wire format (0, 2 int8 per 8, 3 / 4 MX fp8, 10 DeepEP's LogFMT); ``zero_copy``:
    masked rows from the Buffer's combine buffer; ``out`` `[T, H]` or None; flat: ``num_rows`` own rows of ``x`` (then
    ``num_peer`` TP peer rows; -1: not read, the value checks were off); expand without ``multiple_reduction``: every
    expand row goes back as it is;
    ``slot_order``: masked rows are summed per token in slot order (k ascending; the flat and expand layouts always
    are), so the result does not depend on which rank holds an expert (replicas, :mod:`deep_ep_npu.eplb`); expand
    (DeepEP's normal mode): ``by_rank`` sums each token's rows by source rank ascending (else by last top-k slot),
    ``raw_weights`` returns ``expert_scales`` rows as given (else 0 where the slot's expert is not on that rank)."""

    handle: Any
    shared_expert_x: Any = None
    ori_x: Any = None
    const_expert_alpha_1: Any = None
    const_expert_alpha_2: Any = None
    const_expert_v: Any = None
    comm_quant_mode: int = 0
    zero_copy: bool = False
    out: Any = None
    num_rows: int = 0
    num_peer: int = 0
    multiple_reduction: bool = True
    slot_order: bool = False
    by_rank: bool = False
    raw_weights: bool = False


@dataclasses.dataclass
class FFN:
    """The expert FFN of a fused call (GMM1 -> SwiGLU -> GMM2), E_local experts, K = hidden, 2N = GMM1's columns
    (gate, then up): ``w1`` `[E_local, K, 2N]`, ``w2`` `[E_local, N, K]` (int8 with ``w1_scale`` `[E_local, 2N]` /
    ``w2_scale`` `[E_local, K]` fp32 per-channel scales, else float), the output dtype, the SwiGLU clamp (0: none),
    the pipeline's segments (``segment_by`` ``"expert"`` or ``"token"``) and the fused op's routed-row workspace
    ``max_output_size``."""

    w1: Any
    w2: Any
    w1_scale: Any = None
    w2_scale: Any = None
    out_dtype: Any = None
    swiglu_limit: Any = None
    num_segments: Any = None
    segment_by: Any = "expert"
    max_output_size: Any = None
