"""Validated op parameters and the quantities derived from them (reference ascend_ops.md §2.3).

Validation is pure (no communication) and runs first on every rank. ``strict=True`` adds the Atlas A3 hardware
limits so a CPU user can check that a shape would run on A3; the reference path does not need them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import checks
from .ccl_buffer import ccl_buffer_bytes, ccl_buffer_mb
from .errors import invalid, shape
from .group import resolve_group

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NPU_ACT_DTYPES = (torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
COMM_ALGS = ("", "fullmesh_v1", "fullmesh_v2")
MAX_BS = 512


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Where experts live (ascend_ops.md §2.3).

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
    tp_group: dist.ProcessGroup | None = None
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


def validate_layout(
    group: object,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_world_size: int,
    tp_rank_id: int,
    expert_shard_type: int,
    shared_expert_num: int,
    shared_expert_rank_num: int,
    comm_alg: str,
    zero_expert_num: int,
    copy_expert_num: int,
    const_expert_num: int,
    strict: bool,
    group_tp: object = "",
    elastic_info: object = None,
) -> EpLayout:
    pg = resolve_group(group, "group_ep")
    lo_w, hi_w = (2, 768) if strict else (1, 1 << 16)
    checks.in_range(ep_world_size, "ep_world_size", lo_w, hi_w)
    if ep_world_size != dist.get_world_size(pg):
        raise shape("ep_world_size", f"is {ep_world_size} but group_ep has {dist.get_world_size(pg)} ranks")
    checks.in_range(ep_rank_id, "ep_rank_id", 0, ep_world_size - 1)
    if ep_rank_id != dist.get_rank(pg):
        raise shape("ep_rank_id", f"is {ep_rank_id} but this process is rank {dist.get_rank(pg)} of group_ep")
    checks.in_range(moe_expert_num, "moe_expert_num", 1, 1024 if strict else 1 << 20)
    checks.in_range(expert_shard_type, "expert_shard_type", 0, 0, code="param")
    checks.in_range(shared_expert_num, "shared_expert_num", 0, 4, code="param")
    checks.in_range(shared_expert_rank_num, "shared_expert_rank_num", 0, ep_world_size - 1)
    effective_shared = _effective_shared(shared_expert_num, shared_expert_rank_num, ep_world_size)
    moe_ranks = ep_world_size - shared_expert_rank_num
    if moe_expert_num % moe_ranks:
        raise shape(
            "moe_expert_num",
            f"{moe_expert_num} is not divisible by the {moe_ranks} MoE ranks (ep_world_size - shared_expert_rank_num)",
        )
    for name, value in (
        ("zero_expert_num", zero_expert_num),
        ("copy_expert_num", copy_expert_num),
        ("const_expert_num", const_expert_num),
    ):
        checks.in_range(value, name, 0, 1 << 20)
    checks.one_of(comm_alg, "comm_alg", COMM_ALGS, "the reference path implements the A3 fullmesh layout")
    if strict and (moe_expert_num // moe_ranks) * ep_world_size > 2048:
        raise shape("moe_expert_num", "local experts x ep_world_size exceeds 2048 (Atlas A3 limit)")
    tp_group = validate_tp(group_tp, tp_world_size, tp_rank_id, moe_expert_num // moe_ranks)
    layout = EpLayout(
        pg,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        shared_expert_rank_num,
        effective_shared,
        zero_expert_num,
        copy_expert_num,
        const_expert_num,
        tp_world_size,
        tp_rank_id,
        comm_alg,
        strict,
        ep_world_size,
        ep_rank_id,
        tuple(range(ep_world_size)),
        tp_group,
        moe_expert_num,
    )
    if elastic_info is not None:
        if tp_world_size > 1:
            raise invalid(
                "elastic_info", f"is only supported with tp_world_size <= 1, got tp_world_size {tp_world_size}"
            )
        layout = apply_elastic(layout, elastic_info, shared_expert_num)
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


def validate_tp(group_tp: object, tp_world_size: int, tp_rank_id: int, num_local_experts: int):
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
    return tp


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
        layout,
        num_moe_experts=new_e,
        shared_expert_rank_num=new_sr,
        shared_expert_num=shared,
        logical_world_size=new_w,
        logical_rank=table1[layout.rank],
        ep_rank_of=tuple(table2),
    )


def validate_tokens(
    layout: EpLayout, x_param: str, x: object, ids: object, mask: object, global_bs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """Check x `[Bs, H]`, expert_ids `[Bs, K]`, x_active_mask and global_bs; return them, K and global_bs_real."""
    strict = layout.strict
    x = checks.tensor(x, x_param, NPU_ACT_DTYPES if strict else ACT_DTYPES, 2)
    ids = checks.tensor(ids, "expert_ids", (torch.int32,) if strict else ID_DTYPES, 2)
    num_tokens, hidden = x.shape
    checks.in_range(
        num_tokens, f"{x_param}.shape[0] (Bs)", 1 if strict else 0, 256 if layout.comm_alg == "fullmesh_v2" else MAX_BS
    )
    if strict:
        checks.in_range(hidden, f"{x_param}.shape[1] (H)", 1024, 8192)
    elif hidden < 1:
        raise shape(x_param, f"hidden size (dim 1) must be >= 1, got {hidden}")
    max_topk = 12 if layout.comm_alg == "fullmesh_v2" else 16
    topk = checks.expert_ids(ids, "expert_ids", layout.num_expert_ids, num_tokens, max_topk)
    mask = checks.optional_tensor(mask, "x_active_mask", (torch.bool,), (1, 2))
    checks.active_mask(mask, "x_active_mask", num_tokens, topk)
    w = layout.world_size
    checks.in_range(global_bs, "global_bs", 0, MAX_BS * w)
    if global_bs:
        if global_bs % w:
            raise shape("global_bs", f"{global_bs} is not a multiple of ep_world_size {w} (pass max Bs x W)")
        if num_tokens > global_bs // w:
            raise shape("global_bs", f"{global_bs} / W = {global_bs // w} is below this rank's Bs {num_tokens}")
        if strict and mask is not None and num_tokens * w != global_bs and not bool(mask.all()):
            raise shape("x_active_mask", "must be all True when batch sizes differ across ranks (global_bs != Bs*W)")
    return x, ids, mask, topk, global_bs or num_tokens * w


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


def reject_unsupported(**kwargs: object) -> None:
    """Ascend-950-only or not-yet-implemented arguments must be left at their defaults."""
    for name, value in kwargs.items():
        if value is not None:
            raise invalid(name, f"got {value!r}; not supported on the A2/A3 semantics implemented here (leave it None)")
