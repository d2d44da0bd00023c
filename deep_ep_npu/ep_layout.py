"""The expert layout of a MoE distribute op's group (:class:`EpLayout`): world size and rank, routed / shared / zero /
copy / const experts, elastic scaling (``elastic_info``), the platform and the TP pair, validated once from a call's
params by :func:`validate_layout` (no communication), and which pairs of a call go where (:func:`routed_pairs`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import errors as checks
from .errors import invalid, shape
from .group import EPGroup, ep_group
from .group_names import resolve_group
from .npu_types import (
    COMM_ALG_PLATFORMS,
    MAX_WORLD,
    OP_COMM_ALGS,
    PLATFORM_NAMES,
    platform,
    platform_feature,
)

if TYPE_CHECKING:
    from .params import CombineParams, DispatchParams


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Where experts live. Ranks are addressed by their *logical* rank: the EP rank itself, or with ``elastic_info``
    the rank in the scaled-down EP (``Table1[ep_rank]``, -1 for ranks that do not take part). Logical ranks
    ``[0, SR)`` host shared experts, the rest ``L`` routed experts each; ``ep_rank_of[logical]`` is the EP rank."""

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
    logical_world_size: int = 0  # W' (== W without elastic_info)
    logical_rank: int = 0  # -1: this rank does not take part (elastic)
    ep_rank_of: tuple[int, ...] = ()  # logical rank -> EP rank
    tp: EPGroup | None = None
    scales_experts: int = 0  # moe_expert_num as given (rows of ``scales`` after the shared ones)
    platform: str | None = None  # strict's platform: None, "a3" or "a5"

    @property
    def num_local_experts(self) -> int:  # L: routed experts per MoE rank
        return self.num_moe_experts // (self.logical_world_size - self.shared_expert_rank_num)

    @property
    def active(self) -> bool:  # False for a rank that elastic_info scaled out: it sends and receives nothing
        return self.logical_rank >= 0

    @property
    def num_local_experts_here(self) -> int:
        return 1 if 0 <= self.logical_rank < self.shared_expert_rank_num else self.num_local_experts

    def recv_capacity(self, global_bs: int, topk: int) -> int:
        """A: the most rows this rank can receive per TP rank (shared rank: ``maxBs * ceil(W / R)``; with
        elastic_info the larger of both formulas, since the role of a rank can change)."""
        moe = global_bs * min(self.num_local_experts, topk)
        if not self.shared_expert_num:
            return moe
        ranks_per_shared = self.shared_expert_rank_num // self.shared_expert_num
        shared = global_bs // self.world_size * math.ceil(self.logical_world_size / ranks_per_shared)
        if self.logical_world_size != self.world_size or self.ep_rank_of != tuple(range(self.world_size)):
            return max(moe, shared)
        return shared if 0 <= self.logical_rank < self.shared_expert_rank_num else moe


def validate_layout(p: DispatchParams | CombineParams) -> EpLayout:
    """The expert layout of ``p``'s group and expert keywords (no communication)."""
    plat = platform(p.strict)
    pg = resolve_group(p.group_ep, "group_ep")
    checks.in_range(p.ep_world_size, "ep_world_size", 2 if plat else 1, MAX_WORLD[plat])
    if p.ep_world_size != dist.get_world_size(pg):
        raise shape("ep_world_size", f"is {p.ep_world_size} but group_ep has {dist.get_world_size(pg)} ranks")
    checks.in_range(p.ep_rank_id, "ep_rank_id", 0, p.ep_world_size - 1)
    if p.ep_rank_id != dist.get_rank(pg):
        raise shape("ep_rank_id", f"is {p.ep_rank_id} but this process is rank {dist.get_rank(pg)} of group_ep")
    checks.in_range(p.moe_expert_num, "moe_expert_num", 1, 1024 if plat else 1 << 20)
    checks.in_range(p.expert_shard_type, "expert_shard_type", 0, 0, code="param")
    checks.in_range(p.shared_expert_num, "shared_expert_num", 0, 4, code="param")
    checks.in_range(p.shared_expert_rank_num, "shared_expert_rank_num", 0, p.ep_world_size - 1)
    effective_shared = _effective_shared(p.shared_expert_num, p.shared_expert_rank_num, p.ep_world_size)
    num_local = p.moe_expert_num // (moe_ranks := p.ep_world_size - p.shared_expert_rank_num)
    if p.moe_expert_num % moe_ranks:
        raise shape("moe_expert_num", f"{p.moe_expert_num} is not divisible by the {moe_ranks} MoE ranks "
                    "(ep_world_size - shared_expert_rank_num)")  # fmt: skip
    for name in ("zero_expert_num", "copy_expert_num", "const_expert_num"):
        checks.in_range(getattr(p, name), name, 0, 1 << 20)
    checks.one_of(p.comm_alg, "comm_alg", OP_COMM_ALGS, "every one gives the fullmesh layout here")
    from .params import CombineParams  # (params imports this module)

    combine = isinstance(p, CombineParams)
    on_plat = [a for a, o in COMM_ALG_PLATFORMS.items() if plat in o[combine]]
    where = f"{on_plat} for {'combine' if combine else 'dispatch'}_v2"
    platform_feature(plat, "comm_alg", p.comm_alg, COMM_ALG_PLATFORMS[p.comm_alg][combine], where)
    if plat and num_local * p.ep_world_size > 2048:
        raise shape("moe_expert_num", f"local experts x ep_world_size exceeds 2048 ({PLATFORM_NAMES[plat]} limit)")
    # TP domain: tp_world_size 0/1 (none) or 2 (group_tp of 2 ranks, one routed expert per rank)
    checks.in_range(p.tp_world_size, "tp_world_size", 0, 2, code="param")
    checks.in_range(p.tp_rank_id, "tp_rank_id", 0, max(p.tp_world_size, 1) - 1)
    if p.tp_world_size == 2:
        platform_feature(plat, "tp_world_size", 2, ("a3",), "0 or 1 (TP communication is reserved)")
        if p.comm_alg == "hierarchy":
            raise invalid("tp_world_size", "got 2; comm_alg 'hierarchy' supports only tp_world_size <= 1")
    if p.elastic_info is not None:
        platform_feature(plat, "elastic_info", "a tensor", ("a3",), "None (reserved)")
    tp = resolve_group(p.group_tp, "group_tp") if p.tp_world_size == 2 else None
    if tp is not None and dist.get_world_size(tp) != 2:
        raise shape("group_tp", f"has {dist.get_world_size(tp)} ranks, tp_world_size 2 needs 2")
    if tp is not None and dist.get_rank(tp) != p.tp_rank_id:
        raise shape("tp_rank_id", f"is {p.tp_rank_id} but this process is rank {dist.get_rank(tp)} of group_tp")
    if tp is not None and num_local > 1:
        why = f"gives {num_local} local experts per rank; with tp_world_size 2 each rank hosts exactly 1"
        raise shape("moe_expert_num", why)
    if p.elastic_info is not None and p.tp_world_size > 1:
        why = f"is only supported with tp_world_size <= 1, got tp_world_size {p.tp_world_size}"
        raise invalid("elastic_info", why)
    layout = EpLayout(
        pg, p.ep_world_size, p.ep_rank_id, p.moe_expert_num, p.shared_expert_rank_num, effective_shared,
        p.zero_expert_num, p.copy_expert_num, p.const_expert_num, p.tp_world_size, p.tp_rank_id, p.ep_world_size,
        p.ep_rank_id, tuple(range(p.ep_world_size)), None if tp is None else ep_group(tp), p.moe_expert_num, plat,
    )  # fmt: skip
    return layout if p.elastic_info is None else apply_elastic(layout, p.elastic_info, p.shared_expert_num)


def _effective_shared(num: int, ranks: int, world_size: int) -> int:
    """S: 0 when there are no shared-expert ranks (the tiling forces S = 0 for SR = 0, S = 1)."""
    if ranks == 0:
        if num > 1:
            raise invalid("shared_expert_num", f"got {num} with shared_expert_rank_num 0; shared experts need shared-"
                          "expert ranks (use 0 or 1, which both mean none, or set shared_expert_rank_num)")  # fmt: skip
        return 0
    if num == 0:
        raise invalid("shared_expert_num", f"is 0 but shared_expert_rank_num is {ranks}; allowed [1, 4]")
    if ranks % num:
        raise shape("shared_expert_rank_num", f"{ranks} is not a multiple of shared_expert_num {num}")
    if ranks >= world_size:
        raise shape("shared_expert_rank_num", f"{ranks} leaves no MoE rank in {world_size} ranks")
    return num


def apply_elastic(layout: EpLayout, elastic_info: object, shared_expert_num: int) -> EpLayout:
    """Re-lay the experts over the scaled-down EP that ``elastic_info`` describes (`[4 + 2W]` `torch.int32`:
    is_scaled_down, new_rank_count, new_shared_rank_count, new_moe_expert_count, Table1[W], Table2[W])."""
    w, info = layout.world_size, checks.tensor(elastic_info, "elastic_info", (torch.int32,), 1)
    checks.dims(info, "elastic_info", (4 + 2 * w,), "(4 + 2 * ep_world_size,)")
    scaled, new_w, new_sr, new_e = (vals := info.tolist())[:4]
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
    return dataclasses.replace(
        layout, num_moe_experts=new_e, shared_expert_rank_num=new_sr,
        shared_expert_num=_effective_shared(shared_expert_num, new_sr, new_w),
        logical_world_size=new_w, logical_rank=table1[layout.rank], ep_rank_of=tuple(table2),
    )  # fmt: skip


def routed_pairs(layout: EpLayout, ids: torch.Tensor, x_active_mask: torch.Tensor | None,
                 rank_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(token, slot, dest EP rank, local expert) of every pair that is sent, each `[num_pairs]` `torch.int64`.
    A pair (t, k) is sent iff it is active (t inside the 1D mask's prefix, or ``mask[t, k]``) and its id is a routed
    expert (``0 <= id < moe_expert_num``); zero / copy / const experts are handled by combine on the source rank.
    Every active token also goes to shared expert s (slot ``K + s``) on logical rank ``(rank % R) + s * R``. A rank
    that elastic_info scaled out, or that ``rank_mask`` `[W]` marks, sends nothing; nothing goes to marked ranks."""
    dev, empty = ids.device, torch.empty((0,), dtype=torch.int64, device=ids.device)
    if not layout.active or bool(rank_mask[layout.rank]):
        return empty, empty, empty, empty
    valid = (ids >= 0) & (ids < layout.num_moe_experts)
    if x_active_mask is not None:
        valid &= x_active_mask.unsqueeze(1) if x_active_mask.dim() == 1 else x_active_mask
    token, slot = valid.nonzero(as_tuple=True)
    e, num_local = ids[token, slot], layout.num_local_experts
    parts = [(token, slot, layout.shared_expert_rank_num + e // num_local, e % num_local)]
    if layout.shared_expert_num:
        act = active_tokens(x_active_mask, ids.shape[0], dev)
        r = layout.shared_expert_rank_num // layout.shared_expert_num  # ranks per shared expert
        for s in range(layout.shared_expert_num):
            slot_s, logical_s = ids.shape[1] + s, layout.logical_rank % r + s * r
            parts.append((act, torch.full_like(act, slot_s), torch.full_like(act, logical_s), torch.zeros_like(act)))
    token, slot, logical, expert = (torch.cat(c) for c in zip(*parts, strict=True))
    dest = torch.tensor(layout.ep_rank_of, dtype=torch.int64, device=dev)[logical]
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
