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
    """Where experts live: ranks ``[0, SR)`` host shared experts, the rest ``L`` routed experts each."""

    group: dist.ProcessGroup
    world_size: int
    rank: int
    num_moe_experts: int
    shared_expert_rank_num: int
    shared_expert_num: int  # effective S (0 when SR == 0)
    zero_expert_num: int
    copy_expert_num: int
    const_expert_num: int
    tp_world_size: int
    tp_rank_id: int
    comm_alg: str
    strict: bool

    @property
    def num_local_experts(self) -> int:
        """L: routed experts per MoE rank."""
        return self.num_moe_experts // (self.world_size - self.shared_expert_rank_num)

    @property
    def ranks_per_shared_expert(self) -> int:
        return self.shared_expert_rank_num // self.shared_expert_num if self.shared_expert_num else 0

    @property
    def is_shared_rank(self) -> bool:
        return self.rank < self.shared_expert_rank_num

    @property
    def num_local_experts_here(self) -> int:
        return 1 if self.is_shared_rank else self.num_local_experts

    @property
    def num_expert_ids(self) -> int:
        return self.num_moe_experts + self.zero_expert_num + self.copy_expert_num + self.const_expert_num

    def recv_capacity(self, global_bs: int, topk: int) -> int:
        """A: the most rows this rank can receive (shared rank: ``maxBs * ceil(W / R)``)."""
        if self.is_shared_rank:
            return global_bs // self.world_size * math.ceil(self.world_size / self.ranks_per_shared_expert)
        return global_bs * min(self.num_local_experts, topk)


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
    if shared_expert_rank_num:
        raise invalid(
            "shared_expert_rank_num", f"got {shared_expert_rank_num}; shared-expert ranks are not implemented yet"
        )
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
    checks.in_range(tp_world_size, "tp_world_size", 0, 1, code="param")
    checks.in_range(tp_rank_id, "tp_rank_id", 0, max(tp_world_size, 1) - 1)
    checks.one_of(comm_alg, "comm_alg", COMM_ALGS, "the reference path implements the A3 fullmesh layout")
    if strict and (moe_expert_num // moe_ranks) * ep_world_size > 2048:
        raise shape("moe_expert_num", "local experts x ep_world_size exceeds 2048 (Atlas A3 limit)")
    effective_shared = 0 if shared_expert_rank_num == 0 else shared_expert_num
    return EpLayout(
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
