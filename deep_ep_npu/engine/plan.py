"""Which rows leave this rank: (token, slot) pairs routed to (destination rank, local expert), sorted by (destination,
local expert, token), and their rows: one token copy per destination (expanded there), or one per pair when the
encoding depends on the expert (smoothed int8). Own rows last: the remote rows are one contiguous send buffer.
Receivers keep tokens ascending inside each (expert, source) block, so combine returns rows in this order."""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..core.call import Experts


@dataclasses.dataclass
class Plan:
    """Pairs `[P]` `torch.int64` (sorted by (dest, expert, token)) and rows `[num_rows]` (remote rows first)."""

    token: torch.Tensor
    slot: torch.Tensor
    dest: torch.Tensor
    expert: torch.Tensor
    pairs_per_dest: list[int]
    row_token: torch.Tensor
    row_of_pair: torch.Tensor
    rows_per_dest: list[int]
    rank: int
    slot_expert: torch.Tensor | None = None  # `[num_rows, K]` int32 per row and slot: local expert or -1 (if known)
    orders: dict[bool, tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=dict)  # (combine's pair orders)

    @property
    def own_pairs(self) -> slice:
        return slice(lo := sum(self.pairs_per_dest[: self.rank]), lo + self.pairs_per_dest[self.rank])

    def row_slices(self) -> list[slice]:
        """Each destination's rows: the remote ones in rank order, then this rank's."""
        r, me, rows = len(self.rows_per_dest), self.rank, self.rows_per_dest
        begin = [sum(rows[q] for q in range(d) if q != me) for d in range(r)]
        begin[me] = sum(rows) - rows[me]
        return [slice(b, b + n) for b, n in zip(begin, rows, strict=True)]


def make_plan(
    token: torch.Tensor,
    slot: torch.Tensor,
    dest: torch.Tensor,
    expert: torch.Tensor,
    num_tokens: int,
    num_ranks: int,
    rank: int,
    num_local_experts: int,
    per_pair_rows: bool,
) -> Plan:
    """Sort the pairs (`[P]` int64 tensors, any order) and derive the rows that carry them."""
    nt, nl = max(num_tokens, 1), max(num_local_experts, 1)
    order = torch.argsort((dest * nl + expert) * nt + token)
    token, slot, dest, expert = token[order], slot[order], dest[order], expert[order]
    pairs = torch.bincount(dest, minlength=num_ranks).tolist()
    last = torch.where(dest == rank, num_ranks, dest)  # this rank's rows go last
    if per_pair_rows:
        row_order = torch.argsort(last, stable=True)
        row_of_pair = torch.empty_like(row_order)
        row_of_pair[row_order] = torch.arange(row_order.numel(), device=dest.device)
        return Plan(token, slot, dest, expert, pairs, token[row_order], row_of_pair, pairs, rank)
    keys, row_of_pair = torch.unique(last * nt + token, sorted=True, return_inverse=True)
    rows = torch.bincount(keys // nt, minlength=num_ranks + 1).tolist()
    rows[rank] = rows[num_ranks]
    return Plan(token, slot, dest, expert, pairs, keys % nt, row_of_pair, rows[:num_ranks], rank)


def plan_topk(
    topk_idx: torch.Tensor, num_local_experts: int, num_ranks: int, rank: int, mask: torch.Tensor, per_pair_rows: bool
) -> Plan:
    """The plan of the valid entries of ``topk_idx`` `[T, K]` (validated ids; -1: none): pair (t, k) goes to rank
    ``e // L``, local expert ``e % L``; ranks masked in ``mask`` `[R]` (shrink mode) receive nothing, and a masked
    rank sends nothing. Without ``per_pair_rows`` the plan also holds its rows' ``slot_expert`` table."""
    ids, nl = topk_idx.long(), num_local_experts
    if (fast := kernels.plan(ids, nl, num_ranks, rank, mask, per_pair_rows)) is not None:
        token, slot, dest, expert, pairs, row_token, row_of_pair, rows, table = fast
        return Plan(token, slot, dest, expert, pairs, row_token, row_of_pair, rows, rank, table)
    valid = ids >= 0
    if bool(mask.any()):
        valid &= (mask.to(ids.device)[ids.clamp(min=0) // nl] == 0) & (not int(mask[rank]))
    token, slot = valid.nonzero(as_tuple=True)
    e = ids[token, slot]
    return make_plan(token, slot, e // nl, e % nl, len(ids), num_ranks, rank, nl, per_pair_rows)


def plan_call(
    e: Experts, ids: torch.Tensor, x_active_mask: torch.Tensor | None, rank_mask: torch.Tensor, per_pair_rows: bool
) -> Plan:
    """The plan of an op call's ``ids`` `[T, K]` (validated) over the experts ``e``: routed pairs, and each active
    token's shared-expert copies (:func:`routed_pairs`)."""
    sent = (ids >= 0) & (ids < e.num_moe_experts)
    if x_active_mask is not None:
        sent &= x_active_mask.unsqueeze(1) if x_active_mask.dim() == 1 else x_active_mask
    if e.plain and e.logical_rank >= 0 and not e.shared_expert_num and e.num_local:
        # routed experts only, EP rank = id // L: the masked layout's plan of the ids that are sent (the others -1)
        return plan_topk(torch.where(sent, ids, -1), e.num_local, e.world_size, e.rank, rank_mask, per_pair_rows)
    token, slot, dest, expert = routed_pairs(e, ids, sent, x_active_mask, rank_mask)
    num_local = max(e.num_local, 1)
    return make_plan(token, slot, dest, expert, ids.shape[0], e.world_size, e.rank, num_local, per_pair_rows)


def routed_pairs(
    e: Experts, ids: torch.Tensor, sent: torch.Tensor, x_active_mask: torch.Tensor | None, rank_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, dest EP rank, local expert) of every pair that is sent, each `[num_pairs]` `torch.int64`.
    A pair (t, k) is sent (``sent[t, k]``) iff it is active (t inside the 1D mask's prefix, or ``mask[t, k]``) and its
    id is a routed expert (``0 <= id < moe_expert_num``); zero / copy / const experts are handled by combine on the
    source rank. Every active token also goes to shared expert s (slot ``K + s``) on logical rank ``(rank % R) + s *
    R``. A rank that elastic_info scaled out, or that ``rank_mask`` `[W]` marks, sends nothing; nothing goes to marked
    ranks."""
    dev, empty = ids.device, torch.empty((0,), dtype=torch.int64, device=ids.device)
    if e.logical_rank < 0 or bool(rank_mask[e.rank]):
        return empty, empty, empty, empty
    token, slot = sent.nonzero(as_tuple=True)
    expert, num_local = ids[token, slot], e.num_local
    parts = [(token, slot, e.shared_expert_rank_num + expert // num_local, expert % num_local)]
    if e.shared_expert_num:
        if x_active_mask is not None and x_active_mask.dim() == 2:  # the tokens with an active pair
            act = x_active_mask.any(dim=1).nonzero().squeeze(1)
        else:  # all, or the 1D mask's prefix
            act = torch.arange(ids.shape[0] if x_active_mask is None else int(x_active_mask.sum()), device=dev)
        r = e.shared_expert_rank_num // e.shared_expert_num  # ranks per shared expert
        for s in range(e.shared_expert_num):
            slot_s, logical_s = ids.shape[1] + s, e.logical_rank % r + s * r
            parts.append((act, torch.full_like(act, slot_s), torch.full_like(act, logical_s), torch.zeros_like(act)))
    token, slot, logical, expert = (torch.cat(c) for c in zip(*parts, strict=True))
    dest = torch.tensor(e.ep_rank_of, dtype=torch.int64, device=dev)[logical]
    if bool(rank_mask.any()):
        keep = rank_mask.to(dev)[dest] == 0
        token, slot, dest, expert = token[keep], slot[keep], dest[keep], expert[keep]
    return token, slot, dest, expert


def pair_weights(plan: Plan, weights: torch.Tensor, topk: int) -> torch.Tensor:
    """`[P]` fp32: ``weights[token, slot]`` `[T, K]` of each pair, 1 for shared-expert copies (slot >= K)."""
    routed = plan.slot < topk
    out = torch.ones(plan.token.numel(), dtype=torch.float32, device=weights.device)
    out[routed] = weights[plan.token[routed], plan.slot[routed]]
    return out


def smooth_rows(e: Experts, plan: Plan, scales: torch.Tensor, topk: int) -> torch.Tensor:
    """`[num_rows, H]` fp32 smooth scales of per-pair rows: row ``s`` of ``scales`` `[S + E, H]` for shared expert s,
    row ``S + e`` for routed expert e."""
    dev = plan.dest.device
    logical_of = torch.full((e.world_size,), -1, dtype=torch.int64, device=dev)
    logical_of[torch.tensor(e.ep_rank_of, dtype=torch.int64, device=dev)] = torch.arange(len(e.ep_rank_of), device=dev)
    global_expert = (logical_of[plan.dest] - e.shared_expert_rank_num) * e.num_local + plan.expert
    row = torch.where(plan.slot >= topk, plan.slot - topk, e.shared_expert_num + global_expert)
    pair_of_row = torch.empty_like(plan.row_of_pair)
    pair_of_row[plan.row_of_pair] = torch.arange(plan.row_of_pair.numel(), device=pair_of_row.device)
    return scales[row[pair_of_row]]
