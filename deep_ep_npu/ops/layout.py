"""Send plans: which (token, slot) pairs go to which (rank, local expert), in the order the receiver stores them.

Pairs are sorted by (destination rank, local expert, token). The receiver stores rows expert-major, then source
rank, then token, so a stable sort of the concatenated per-source blocks by (expert, source) yields the final
order, and combine can send rows back in exactly the order the source expects (no metadata needed).
"""

from __future__ import annotations

import dataclasses

import torch

from .spec import EpLayout


@dataclasses.dataclass
class SendPlan:
    """Pairs `[num_pairs]` (all `torch.int64`, sorted by (dest, expert, token)) and the payload rows they use.

    A row is one encoded token copy per destination rank (``per_pair_rows=False``: a token routed to several
    experts of one rank travels once and is expanded on the receiver) or per pair (``per_pair_rows=True``, needed
    when the encoding depends on the expert, e.g. smoothed int8 quant).
    """

    token: torch.Tensor
    slot: torch.Tensor
    dest: torch.Tensor
    expert: torch.Tensor
    pairs_per_dest: list[int]
    row_of_pair: torch.Tensor
    row_token: torch.Tensor
    row_expert: torch.Tensor | None
    rows_per_dest: list[int]

    @property
    def num_pairs(self) -> int:
        return int(self.token.numel())


def make_send_plan(
    token: torch.Tensor,
    slot: torch.Tensor,
    dest: torch.Tensor,
    expert: torch.Tensor,
    *,
    num_tokens: int,
    world_size: int,
    max_local_experts: int,
    per_pair_rows: bool,
) -> SendPlan:
    """Sort the pairs (any order in, `[num_pairs]` int64 tensors) and derive the payload rows."""
    nt = max(num_tokens, 1)
    key = (dest * max_local_experts + expert) * nt + token
    order = torch.argsort(key)
    token, slot, dest, expert = token[order], slot[order], dest[order], expert[order]
    pairs_per_dest = torch.bincount(dest, minlength=world_size).tolist()
    if per_pair_rows:
        row_of_pair = torch.arange(token.numel(), dtype=torch.int64)
        row_token, row_expert, rows_per_dest = token, expert, pairs_per_dest
    else:
        row_key, row_of_pair = torch.unique(dest * nt + token, sorted=True, return_inverse=True)
        row_token, row_expert = row_key % nt, None
        rows_per_dest = torch.bincount(row_key // nt, minlength=world_size).tolist()
    return SendPlan(token, slot, dest, expert, pairs_per_dest, row_of_pair, row_token, row_expert, rows_per_dest)


def receive_order(expert: torch.Tensor, src: torch.Tensor, world_size: int) -> torch.Tensor:
    """Stable permutation putting received pairs (concatenated by source rank) expert-major, then source rank."""
    return torch.argsort(expert * world_size + src, stable=True)


def expert_major_counts(
    expert: torch.Tensor, src: torch.Tensor, num_local_experts: int, world_size: int
) -> torch.Tensor:
    """`[num_local_experts, world_size]` int64: pairs received per (local expert, source rank)."""
    flat = torch.bincount(expert * world_size + src, minlength=num_local_experts * world_size)
    return flat.view(num_local_experts, world_size)


def active_tokens(x_active_mask: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """Tokens sent to the shared experts, `[n]` `torch.int64`: all, the 1D mask's prefix, or (2D mask) the tokens
    with at least one active pair."""
    if x_active_mask is None:
        return torch.arange(num_tokens)
    if x_active_mask.dim() == 1:
        return torch.arange(int(x_active_mask.sum()))
    return x_active_mask.any(dim=1).nonzero().squeeze(1)


def routed_pairs(
    layout: EpLayout, expert_ids: torch.Tensor, x_active_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, dest EP rank, local expert) of every pair that is sent, each `[num_pairs]` `torch.int64`.

    A pair (t, k) is sent iff it is active (t inside the 1D mask's prefix, or ``mask[t, k]``) and its id is a routed
    expert (< moe_expert_num); zero/copy/const experts are handled by combine on the source rank. Every active token
    also goes to shared expert s (slot ``K + s``) on logical rank ``(rank % R) + s * R``. A rank that elastic_info
    scaled out sends nothing.
    """
    ids = expert_ids.long()
    if not layout.active:
        empty = torch.empty((0,), dtype=torch.int64)
        return empty, empty, empty, empty
    valid = ids < layout.num_moe_experts
    if x_active_mask is not None:
        valid &= x_active_mask.unsqueeze(1) if x_active_mask.dim() == 1 else x_active_mask
    token, slot = valid.nonzero(as_tuple=True)
    e = ids[token, slot]
    num_local = layout.num_local_experts
    tokens, slots, dests, experts = [token], [slot], [layout.shared_expert_rank_num + e // num_local], [e % num_local]
    if layout.shared_expert_num:
        act = active_tokens(x_active_mask, ids.shape[0])
        r = layout.ranks_per_shared_expert
        for s in range(layout.shared_expert_num):
            tokens.append(act)
            slots.append(torch.full_like(act, ids.shape[1] + s))
            dests.append(torch.full_like(act, layout.logical_rank % r + s * r))
            experts.append(torch.zeros_like(act))
    ep_rank_of = torch.tensor(layout.ep_rank_of, dtype=torch.int64)
    return torch.cat(tokens), torch.cat(slots), ep_rank_of[torch.cat(dests)], torch.cat(experts)


def build_plan(
    layout: EpLayout, expert_ids: torch.Tensor, x_active_mask: torch.Tensor | None, per_pair_rows: bool
) -> SendPlan:
    """The send plan of this rank's pairs (:func:`routed_pairs`)."""
    token, slot, dest, expert = routed_pairs(layout, expert_ids, x_active_mask)
    return make_send_plan(
        token,
        slot,
        dest,
        expert,
        num_tokens=expert_ids.shape[0],
        world_size=layout.world_size,
        max_local_experts=max(layout.num_local_experts, 1),
        per_pair_rows=per_pair_rows,
    )


def logical_rank_of(layout: EpLayout) -> torch.Tensor:
    """`[W]` `torch.int64`: the logical rank of each EP rank (-1: scaled out)."""
    out = torch.full((layout.world_size,), -1, dtype=torch.int64)
    out[torch.tensor(layout.ep_rank_of, dtype=torch.int64)] = torch.arange(len(layout.ep_rank_of))
    return out
