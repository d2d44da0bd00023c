"""The parameters of the MoE distribute ops as typed objects, and the one rule set that validates them.

:class:`DispatchParams` / :class:`CombineParams` have exactly torch_npu's keyword names; they are built once from
the public call (the ops, the Buffer's flat methods, MegaMoE) and validated once by :meth:`DispatchParams.validate`
/ :meth:`CombineParams.validate`, which return what the engine needs. Validation is pure (no communication) and
runs first on every rank. ``strict=True`` adds the Atlas A3 hardware limits so a CPU user can check that a shape
would run on A3; the engine does not need them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from . import errors as checks
from .errors import invalid, null, shape
from .group import EPGroup, ep_group, resolve_group
from .sizes import ccl_buffer_bytes, ccl_buffer_mb

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NPU_ACT_DTYPES = (torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
COMM_ALGS = ("", "fullmesh_v1", "fullmesh_v2")
MAX_BS = 512


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Where experts live.

    Ranks are addressed by their *logical* rank: the EP rank itself, or with ``elastic_info`` the rank in the
    scaled-down EP (``Table1[ep_rank]``, -1 for ranks that do not take part). Logical ranks ``[0, SR)`` host shared
    experts, the rest ``L`` routed experts each; ``ep_rank_of[logical]`` is the EP rank to talk to.
    """

    group: dist.ProcessGroup
    world_size: int  # W: ranks of group_ep (the communication domain)
    rank: int
    num_moe_experts: int  # E in the active layout (elastic: new_moe_expert_count)
    shared_expert_rank_num: int  # SR in the active layout
    shared_expert_num: int  # effective S (0 when SR == 0)
    zero_expert_num: int
    copy_expert_num: int
    const_expert_num: int
    tp_world_size: int
    tp_rank_id: int
    comm_alg: str
    strict: bool
    logical_world_size: int = 0  # W' (== W without elastic_info)
    logical_rank: int = 0  # -1: this rank does not take part (elastic)
    ep_rank_of: tuple[int, ...] = ()  # logical rank -> EP rank
    tp: EPGroup | None = None
    scales_experts: int = 0  # moe_expert_num as given (rows of ``scales`` after the shared ones)

    @property
    def num_local_experts(self) -> int:
        """L: routed experts per MoE rank."""
        return self.num_moe_experts // (self.logical_world_size - self.shared_expert_rank_num)

    @property
    def ranks_per_shared_expert(self) -> int:
        return self.shared_expert_rank_num // self.shared_expert_num if self.shared_expert_num else 0

    @property
    def active(self) -> bool:
        """False for a rank that elastic_info scaled out: it sends and receives nothing."""
        return self.logical_rank >= 0

    @property
    def is_shared_rank(self) -> bool:
        return 0 <= self.logical_rank < self.shared_expert_rank_num

    @property
    def num_local_experts_here(self) -> int:
        return 1 if self.is_shared_rank else self.num_local_experts

    @property
    def num_expert_ids(self) -> int:
        return self.num_moe_experts + self.zero_expert_num + self.copy_expert_num + self.const_expert_num

    @property
    def elastic(self) -> bool:
        return self.logical_world_size != self.world_size or self.ep_rank_of != tuple(range(self.world_size))

    def recv_capacity(self, global_bs: int, topk: int) -> int:
        """A: the most rows this rank can receive per TP rank (shared rank: ``maxBs * ceil(W / R)``; with
        elastic_info the larger of both formulas, since the role of a rank can change)."""
        moe = global_bs * min(self.num_local_experts, topk)
        if not self.shared_expert_num:
            return moe
        shared = global_bs // self.world_size * math.ceil(self.logical_world_size / self.ranks_per_shared_expert)
        if self.elastic:
            return max(moe, shared)
        return shared if self.is_shared_rank else moe


def validate_layout(p: DispatchParams | CombineParams) -> EpLayout:
    """The expert layout of ``p``'s group and expert keywords (no communication)."""
    pg = resolve_group(p.group_ep, "group_ep")
    lo_w, hi_w = (2, 768) if p.strict else (1, 1 << 16)
    checks.in_range(p.ep_world_size, "ep_world_size", lo_w, hi_w)
    if p.ep_world_size != dist.get_world_size(pg):
        raise shape("ep_world_size", f"is {p.ep_world_size} but group_ep has {dist.get_world_size(pg)} ranks")
    checks.in_range(p.ep_rank_id, "ep_rank_id", 0, p.ep_world_size - 1)
    if p.ep_rank_id != dist.get_rank(pg):
        raise shape("ep_rank_id", f"is {p.ep_rank_id} but this process is rank {dist.get_rank(pg)} of group_ep")
    checks.in_range(p.moe_expert_num, "moe_expert_num", 1, 1024 if p.strict else 1 << 20)
    checks.in_range(p.expert_shard_type, "expert_shard_type", 0, 0, code="param")
    checks.in_range(p.shared_expert_num, "shared_expert_num", 0, 4, code="param")
    checks.in_range(p.shared_expert_rank_num, "shared_expert_rank_num", 0, p.ep_world_size - 1)
    effective_shared = _effective_shared(p.shared_expert_num, p.shared_expert_rank_num, p.ep_world_size)
    moe_ranks = p.ep_world_size - p.shared_expert_rank_num
    if p.moe_expert_num % moe_ranks:
        raise shape(
            "moe_expert_num",
            f"{p.moe_expert_num} is not divisible by the {moe_ranks} MoE ranks "
            "(ep_world_size - shared_expert_rank_num)",
        )
    for name in ("zero_expert_num", "copy_expert_num", "const_expert_num"):
        checks.in_range(getattr(p, name), name, 0, 1 << 20)
    checks.one_of(p.comm_alg, "comm_alg", COMM_ALGS, "the reference path implements the A3 fullmesh layout")
    if p.strict and (p.moe_expert_num // moe_ranks) * p.ep_world_size > 2048:
        raise shape("moe_expert_num", "local experts x ep_world_size exceeds 2048 (Atlas A3 limit)")
    tp_group = validate_tp(p.group_tp, p.tp_world_size, p.tp_rank_id, p.moe_expert_num // moe_ranks)
    layout = EpLayout(
        pg, p.ep_world_size, p.ep_rank_id, p.moe_expert_num, p.shared_expert_rank_num, effective_shared,
        p.zero_expert_num, p.copy_expert_num, p.const_expert_num, p.tp_world_size, p.tp_rank_id, p.comm_alg, p.strict,
        p.ep_world_size, p.ep_rank_id, tuple(range(p.ep_world_size)), tp_group, p.moe_expert_num,
    )  # fmt: skip
    if p.elastic_info is not None:
        if p.tp_world_size > 1:
            raise invalid(
                "elastic_info", f"is only supported with tp_world_size <= 1, got tp_world_size {p.tp_world_size}"
            )
        layout = apply_elastic(layout, p.elastic_info, p.shared_expert_num)
    return layout


def _effective_shared(shared_expert_num: int, shared_expert_rank_num: int, world_size: int) -> int:
    """S: 0 when there are no shared-expert ranks (the tiling forces S = 0 for SR = 0, S = 1)."""
    if shared_expert_rank_num == 0:
        if shared_expert_num > 1:
            raise invalid(
                "shared_expert_num",
                f"got {shared_expert_num} with shared_expert_rank_num 0; shared experts need shared-expert ranks "
                "(use 0 or 1, which both mean none, or set shared_expert_rank_num)",
            )
        return 0
    if shared_expert_num == 0:
        raise invalid(
            "shared_expert_num", f"is 0 but shared_expert_rank_num is {shared_expert_rank_num}; allowed [1, 4]"
        )
    if shared_expert_rank_num % shared_expert_num:
        raise shape(
            "shared_expert_rank_num",
            f"{shared_expert_rank_num} is not a multiple of shared_expert_num {shared_expert_num}",
        )
    if shared_expert_rank_num >= world_size:
        raise shape("shared_expert_rank_num", f"{shared_expert_rank_num} leaves no MoE rank in {world_size} ranks")
    return shared_expert_num


def validate_tp(group_tp: object, tp_world_size: int, tp_rank_id: int, num_local_experts: int) -> EPGroup | None:
    """TP domain: tp_world_size 0/1 (none) or 2 (group_tp of 2 ranks, one routed expert per rank)."""
    checks.in_range(tp_world_size, "tp_world_size", 0, 2, code="param")
    checks.in_range(tp_rank_id, "tp_rank_id", 0, max(tp_world_size, 1) - 1)
    if tp_world_size < 2:
        return None
    tp = resolve_group(group_tp, "group_tp")
    if dist.get_world_size(tp) != 2:
        raise shape("group_tp", f"has {dist.get_world_size(tp)} ranks, tp_world_size 2 needs 2")
    if dist.get_rank(tp) != tp_rank_id:
        raise shape("tp_rank_id", f"is {tp_rank_id} but this process is rank {dist.get_rank(tp)} of group_tp")
    if num_local_experts > 1:
        raise shape(
            "moe_expert_num",
            f"gives {num_local_experts} local experts per rank; with tp_world_size 2 each rank hosts exactly 1",
        )
    return ep_group(tp)


def apply_elastic(layout: EpLayout, elastic_info: object, shared_expert_num: int) -> EpLayout:
    """Re-lay the experts over the scaled-down EP that ``elastic_info`` describes (`[4 + 2W]` `torch.int32`:
    is_scaled_down, new_rank_count, new_shared_rank_count, new_moe_expert_count, Table1[W], Table2[W])."""
    w = layout.world_size
    info = checks.tensor(elastic_info, "elastic_info", (torch.int32,), 1)
    checks.dims(info, "elastic_info", (4 + 2 * w,), "(4 + 2 * ep_world_size,)")
    vals = info.tolist()
    scaled, new_w, new_sr, new_e = vals[:4]
    checks.in_range(scaled, "elastic_info[0] (is_scaled_down)", 0, 1)
    if not scaled:
        return layout
    checks.in_range(new_w, "elastic_info[1] (new_rank_count)", 1, w)
    checks.in_range(new_sr, "elastic_info[2] (new_shared_rank_count)", 0, new_w - 1)
    checks.in_range(new_e, "elastic_info[3] (new_moe_expert_count)", 1, layout.scales_experts)
    if new_e % (new_w - new_sr):
        raise shape("elastic_info[3] (new_moe_expert_count)", f"{new_e} is not divisible by {new_w - new_sr} MoE ranks")
    table1, table2 = vals[4 : 4 + w], vals[4 + w : 4 + w + new_w]
    if sorted(v for v in table1 if v >= 0) != list(range(new_w)) or any(v < -1 for v in table1):
        raise shape("elastic_info", f"Table1 {table1} must map exactly {new_w} EP ranks onto 0..{new_w - 1}, others -1")
    if any(not 0 <= e < w or table1[e] != i for i, e in enumerate(table2)):
        raise shape("elastic_info", f"Table2 {table2} must be the inverse of Table1 {table1}")
    shared = _effective_shared(shared_expert_num, new_sr, new_w)
    return dataclasses.replace(
        layout, num_moe_experts=new_e, shared_expert_rank_num=new_sr, shared_expert_num=shared,
        logical_world_size=new_w, logical_rank=table1[layout.rank], ep_rank_of=tuple(table2),
    )  # fmt: skip


def check_ccl_buffer(layout: EpLayout, ccl_buffer_size: int | None, max_bs: int, hidden: int, topk: int) -> None:
    """Refuse shapes that would not fit a ``ccl_buffer_size`` MB window, naming the size that would."""
    if ccl_buffer_size is None:
        return
    need = ccl_buffer_mb(
        ccl_buffer_bytes(
            layout.world_size, max_bs, hidden, layout.num_local_experts, topk, layout.shared_expert_num, layout.comm_alg
        )
    )
    if ccl_buffer_size < need:
        raise shape(
            "ccl_buffer_size",
            f"{ccl_buffer_size} MB is too small for W={layout.world_size}, max Bs={max_bs}, H={hidden}, "
            f"L={layout.num_local_experts}, K={topk}: at least {need} MB is needed",
        )


def _tokens(layout: EpLayout, x_param: str, x: object, ids: object, mask: object, global_bs: int, no_expert: bool):
    """x `[Bs, H]`, expert_ids `[Bs, K]`, x_active_mask and global_bs; returns them (ids as int64), K and
    global_bs_real."""
    strict = layout.strict
    x = checks.tensor(x, x_param, NPU_ACT_DTYPES if strict else ACT_DTYPES, 2)
    checks.tensor(ids, "topk_idx" if no_expert else "expert_ids", (torch.int32,) if strict else ID_DTYPES, 2)
    num_tokens, hidden = x.shape
    max_bs = 256 if layout.comm_alg == "fullmesh_v2" else MAX_BS
    checks.in_range(num_tokens, f"{x_param}.shape[0] (Bs)", 1 if strict else 0, max_bs)
    if strict:
        checks.in_range(hidden, f"{x_param}.shape[1] (H)", 1024, 8192)
    elif hidden < 1:
        raise shape(x_param, f"hidden size (dim 1) must be >= 1, got {hidden}")
    max_topk = 12 if layout.comm_alg == "fullmesh_v2" else 16
    what = " (moe + zero + copy + const experts)"
    param = "topk_idx" if no_expert else "expert_ids"  # the callers that allow -1 name it as DeepEP does
    ids_ = checks.expert_ids(ids, param, layout.num_expert_ids, num_tokens, max_topk, no_expert, what).long()
    topk = ids_.shape[1]
    mask_ = checks.optional_tensor(mask, "x_active_mask", (torch.bool,), (1, 2))
    if mask_ is not None and mask_.dim() == 1:
        if mask_.shape[0] != num_tokens:
            raise shape("x_active_mask", f"1D mask has {mask_.shape[0]} entries, expected Bs = {num_tokens}")
        n = int(mask_.sum())
        if n and not bool(mask_[:n].all()):
            raise shape("x_active_mask", "a 1D mask must mark a prefix of active tokens (all True entries first)")
    elif mask_ is not None and tuple(mask_.shape) != (num_tokens, topk):
        raise shape(
            "x_active_mask", f"2D mask shape {tuple(mask_.shape)} does not match (Bs, K) = ({num_tokens}, {topk})"
        )
    w = layout.world_size
    checks.in_range(global_bs, "global_bs", 0, MAX_BS * w)
    if global_bs:
        if global_bs % w:
            raise shape("global_bs", f"{global_bs} is not a multiple of ep_world_size {w} (pass max Bs x W)")
        if num_tokens > global_bs // w:
            raise shape("global_bs", f"{global_bs} / W = {global_bs // w} is below this rank's Bs {num_tokens}")
        if strict and mask_ is not None and num_tokens * w != global_bs and not bool(mask_.all()):
            raise shape("x_active_mask", "must be all True when batch sizes differ across ranks (global_bs != Bs*W)")
    return x, ids_, mask_, topk, global_bs or num_tokens * w


def _performance_info(value: object, world_size: int) -> torch.Tensor | None:
    perf = checks.optional_tensor(value, "performance_info", (torch.int64,), 1)
    if perf is not None:
        checks.dims(perf, "performance_info", (world_size,), "(ep_world_size,)")
    return perf


@dataclasses.dataclass
class _Common:
    """The keywords both ops take (same names and defaults)."""

    _: dataclasses.KW_ONLY
    x_active_mask: Any = None
    elastic_info: Any = None
    performance_info: Any = None
    group_tp: Any = ""
    tp_world_size: Any = 0
    tp_rank_id: Any = 0
    expert_shard_type: Any = 0
    shared_expert_num: Any = 1
    shared_expert_rank_num: Any = 0
    global_bs: Any = 0
    comm_alg: Any = ""
    zero_expert_num: Any = 0
    copy_expert_num: Any = 0
    const_expert_num: Any = 0
    strict: Any = False
    no_expert: bool = False


@dataclasses.dataclass
class DispatchParams(_Common):
    """The arguments of ``npu_moe_distribute_dispatch_v2``, by its keyword names (documented on
    :func:`deep_ep_npu.ops.moe_distribute_dispatch_v2`), plus ``ccl_buffer_size`` / ``strict`` (ours) and
    ``no_expert`` (internal: -1 in ``expert_ids`` means "no expert" and errors name it ``topk_idx``, as DeepEP; the
    Buffer's flat methods and MegaMoE)."""

    x: Any
    expert_ids: Any
    group_ep: Any
    ep_world_size: Any
    ep_rank_id: Any
    moe_expert_num: Any
    _: dataclasses.KW_ONLY
    scales: Any = None
    expert_scales: Any = None
    quant_mode: Any = 0
    expert_token_nums_type: Any = 1
    y_dtype: Any = None
    x_dtype: Any = None
    scales_dtype: Any = None
    ccl_buffer_size: Any = None

    def validate(self) -> ValidDispatch:
        """Check every argument (no communication); raise :class:`~deep_ep_npu.errors.MoeDistributeError` naming
        the first bad one."""
        layout = validate_layout(self)
        x, ids, mask, topk, global_bs = _tokens(
            layout, "x", self.x, self.expert_ids, self.x_active_mask, self.global_bs, self.no_expert
        )
        hidden = x.shape[1]
        quant = checks.one_of(self.quant_mode, "quant_mode", (0, 2), "A2/A3 support 0 (none) and 2 (per-token int8)")
        checks.one_of(self.expert_token_nums_type, "expert_token_nums_type", (0, 1))
        scales = checks.optional_tensor(self.scales, "scales", (torch.float32,), 2)
        if scales is not None:
            rows = layout.shared_expert_num + layout.scales_experts
            checks.dims(scales, "scales", (rows, hidden), "(S + moe_expert_num, H)")
        expert_scales = checks.optional_tensor(self.expert_scales, "expert_scales", (torch.float32,), 2)
        if expert_scales is not None:
            checks.dims(expert_scales, "expert_scales", (x.shape[0], topk), "(Bs, K)")
        perf = _performance_info(self.performance_info, layout.world_size)
        for name in ("y_dtype", "x_dtype", "scales_dtype"):
            if getattr(self, name) is not None:
                raise invalid(
                    name, f"got {getattr(self, name)!r}; not supported on the A2/A3 semantics (leave it None)"
                )
        check_ccl_buffer(layout, self.ccl_buffer_size, global_bs // layout.world_size, hidden, topk)
        return ValidDispatch(
            layout, x, ids, mask, topk, self.global_bs, global_bs, quant == 2, scales, expert_scales, perf,
            self.expert_token_nums_type,
        )  # fmt: skip


@dataclasses.dataclass
class ValidDispatch:
    """A validated dispatch: ``ids`` `[Bs, K]` int64; ``global_bs_real`` = ``global_bs or Bs * W``."""

    layout: EpLayout
    x: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor | None
    topk: int
    global_bs: int
    global_bs_real: int
    quant: bool
    scales: torch.Tensor | None
    expert_scales: torch.Tensor | None
    performance_info: torch.Tensor | None
    expert_token_nums_type: int


@dataclasses.dataclass
class CombineParams(_Common):
    """The arguments of ``npu_moe_distribute_combine_v2``, by its keyword names (documented on
    :func:`deep_ep_npu.ops.moe_distribute_combine_v2`), plus ``strict`` (ours) and ``no_expert`` (internal, as in
    :class:`DispatchParams`)."""

    expand_x: Any
    expert_ids: Any
    assist_info_for_combine: Any
    ep_send_counts: Any
    expert_scales: Any
    group_ep: Any
    ep_world_size: Any
    ep_rank_id: Any
    moe_expert_num: Any
    _: dataclasses.KW_ONLY
    tp_send_counts: Any = None
    expand_scales: Any = None
    shared_expert_x: Any = None
    ori_x: Any = None
    const_expert_alpha_1: Any = None
    const_expert_alpha_2: Any = None
    const_expert_v: Any = None
    comm_quant_mode: Any = 0

    def validate(self) -> ValidCombine:
        """Check every argument (no communication), as :meth:`DispatchParams.validate`."""
        layout = validate_layout(self)
        dtypes = NPU_ACT_DTYPES if layout.strict else ACT_DTYPES
        expand_x = checks.tensor(self.expand_x, "expand_x", dtypes, 2)
        hidden = expand_x.shape[1]
        probe = checks.tensor(self.expert_ids, "expert_ids", ID_DTYPES, 2)  # x's shape from expert_ids, expand_x
        x_like = expand_x.new_empty((probe.shape[0], hidden))
        _, ids, mask, topk, global_bs = _tokens(
            layout, "expand_x", x_like, probe, self.x_active_mask, self.global_bs, self.no_expert
        )
        num_tokens = ids.shape[0]
        assist = checks.tensor(self.assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
        counts = checks.tensor(self.ep_send_counts, "ep_send_counts", (torch.int32,), 1)
        weights = checks.tensor(self.expert_scales, "expert_scales", (torch.float32,), 2)
        checks.dims(weights, "expert_scales", (num_tokens, topk), "(Bs, K)")
        shared_x = checks.optional_tensor(self.shared_expert_x, "shared_expert_x", (expand_x.dtype,), (2, 3))
        if shared_x is not None:
            if layout.shared_expert_rank_num:
                raise shape("shared_expert_x", "is only allowed when shared_expert_rank_num == 0")
            if shared_x.dim() == 3:
                if shared_x.shape[0] * shared_x.shape[1] != num_tokens or shared_x.shape[2] != hidden:
                    raise shape("shared_expert_x", f"3D shape {tuple(shared_x.shape)} must be (a, b, H) with a*b = Bs")
                shared_x = shared_x.reshape(num_tokens, hidden)
            checks.dims(shared_x, "shared_expert_x", (num_tokens, hidden), "(Bs, H)")
        quant = checks.one_of(self.comm_quant_mode, "comm_quant_mode", (0, 2), "0 none, 2 int8 with 8-element scales")
        if quant == 2 and layout.tp_world_size == 2:
            raise invalid("comm_quant_mode", "2 (int8 comm quant) is not supported with tp_world_size 2")
        if quant == 2 and hidden % 8:
            raise shape("expand_x", f"hidden {hidden} must be a multiple of 8 for comm_quant_mode 2")
        special = _special(self, layout, num_tokens, hidden, expand_x.dtype)
        perf = _performance_info(self.performance_info, layout.world_size)
        w, num_local, tp = layout.world_size, layout.num_local_experts_here, max(layout.tp_world_size, 1)
        if counts.numel() < w * num_local * tp:
            need = f"W * L{' * 2' if tp == 2 else ''} = {w * num_local * tp}"
            raise shape("ep_send_counts", f"has {counts.numel()} entries, needs {need}")
        num_rows, num_peer = int(counts[w * num_local - 1]), 0
        if layout.tp_world_size == 2:
            tp_counts = checks.tensor(self.tp_send_counts, "tp_send_counts", (torch.int32,), 1)
            checks.dims(tp_counts, "tp_send_counts", (2,), "(tp_world_size,)")
            num_peer = int(counts[2 * w * num_local - 1]) - num_rows
            if int(tp_counts[layout.tp_rank_id]) != num_rows or int(tp_counts[1 - layout.tp_rank_id]) != num_peer:
                raise shape(
                    "tp_send_counts",
                    f"{tp_counts.tolist()} does not match ep_send_counts ({num_rows} own rows, {num_peer} peer "
                    "rows); pass dispatch's tp_recv_counts unchanged",
                )
        capacity = layout.recv_capacity(global_bs, topk)
        if not (0 <= num_rows <= capacity and 0 <= num_peer <= capacity and num_rows + num_peer <= expand_x.shape[0]):
            raise shape(
                "ep_send_counts",
                f"total {num_rows} rows (+{num_peer} TP peer rows), but expand_x has {expand_x.shape[0]} and "
                f"A = {capacity}",
            )
        if assist.numel() < 3 * num_rows:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs 3 * {num_rows}")
        return ValidCombine(
            layout, expand_x, ids, mask, topk, global_bs, weights, shared_x, quant == 2, special, perf, assist,
            num_rows, num_peer,
        )  # fmt: skip


@dataclasses.dataclass
class ValidCombine:
    """A validated combine: ``num_rows`` own rows of ``expand_x`` (then ``num_peer`` TP peer rows)."""

    layout: EpLayout
    expand_x: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor | None
    topk: int
    global_bs_real: int
    weights: torch.Tensor
    shared_x: torch.Tensor | None
    comm_quant: bool
    special: dict[str, torch.Tensor | None]
    performance_info: torch.Tensor | None
    assist: torch.Tensor
    num_rows: int
    num_peer: int


def _special(p: CombineParams, layout: EpLayout, num_tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    """``ori_x`` `[Bs, H]` (required iff copy or const experts exist) and ``const_expert_alpha_1/_2`` /
    ``const_expert_v`` `[const_expert_num, H]` (required iff const experts exist), all in expand_x's dtype."""
    out: dict[str, torch.Tensor | None] = {}
    ori = checks.optional_tensor(p.ori_x, "ori_x", (dtype,), 2)
    if (layout.copy_expert_num or layout.const_expert_num) and ori is None:
        raise null("ori_x", "copy_expert_num / const_expert_num are nonzero")
    if ori is not None:
        checks.dims(ori, "ori_x", (num_tokens, hidden), "(Bs, H)")
    out["ori_x"] = ori
    for name in ("const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v"):
        t = checks.optional_tensor(getattr(p, name), name, (dtype,), 2)
        if layout.const_expert_num and t is None:
            raise null(name, f"const_expert_num is {layout.const_expert_num}")
        if t is not None:
            checks.dims(t, name, (layout.const_expert_num, hidden), "(const_expert_num, H)")
        out[name] = t
    return out


def routed_pairs(
    layout: EpLayout, ids: torch.Tensor, x_active_mask: torch.Tensor | None, rank_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, dest EP rank, local expert) of every pair that is sent, each `[num_pairs]` `torch.int64`.

    A pair (t, k) is sent iff it is active (t inside the 1D mask's prefix, or ``mask[t, k]``) and its id is a routed
    expert (``0 <= id < moe_expert_num``); zero / copy / const experts are handled by combine on the source rank.
    Every active token also goes to shared expert s (slot ``K + s``) on logical rank ``(rank % R) + s * R``. A rank
    that elastic_info scaled out, or that ``rank_mask`` `[W]` marks, sends nothing; nothing goes to marked ranks.
    """
    dev = ids.device
    empty = torch.empty((0,), dtype=torch.int64, device=dev)
    if not layout.active or bool(rank_mask[layout.rank]):
        return empty, empty, empty, empty
    valid = (ids >= 0) & (ids < layout.num_moe_experts)
    if x_active_mask is not None:
        valid &= x_active_mask.unsqueeze(1) if x_active_mask.dim() == 1 else x_active_mask
    token, slot = valid.nonzero(as_tuple=True)
    e = ids[token, slot]
    num_local = layout.num_local_experts
    tokens, slots, dests, experts = [token], [slot], [layout.shared_expert_rank_num + e // num_local], [e % num_local]
    if layout.shared_expert_num:
        act = active_tokens(x_active_mask, ids.shape[0], dev)
        r = layout.ranks_per_shared_expert
        for s in range(layout.shared_expert_num):
            tokens.append(act)
            slots.append(torch.full_like(act, ids.shape[1] + s))
            dests.append(torch.full_like(act, layout.logical_rank % r + s * r))
            experts.append(torch.zeros_like(act))
    dest = torch.tensor(layout.ep_rank_of, dtype=torch.int64, device=dev)[torch.cat(dests)]
    token, slot, expert = torch.cat(tokens), torch.cat(slots), torch.cat(experts)
    if bool(rank_mask.any()):
        keep = rank_mask.to(dev)[dest] == 0
        token, slot, dest, expert = token[keep], slot[keep], dest[keep], expert[keep]
    return token, slot, dest, expert


def active_tokens(x_active_mask: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Tokens sent to the shared experts, `[n]` `torch.int64`: all, the 1D mask's prefix, or (2D mask) the tokens
    with at least one active pair."""
    if x_active_mask is None:
        return torch.arange(num_tokens, device=device)
    if x_active_mask.dim() == 1:
        return torch.arange(int(x_active_mask.sum()), device=device)
    return x_active_mask.any(dim=1).nonzero().squeeze(1)


def logical_rank_of(layout: EpLayout) -> torch.Tensor:
    """`[W]` `torch.int64`: the logical rank of each EP rank (-1: scaled out)."""
    out = torch.full((layout.world_size,), -1, dtype=torch.int64)
    out[torch.tensor(layout.ep_rank_of, dtype=torch.int64)] = torch.arange(len(layout.ep_rank_of))
    return out
