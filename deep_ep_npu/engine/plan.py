"""Which rows leave this rank: (token, slot) pairs routed to (destination rank, local expert), and their rows.

Pairs are sorted by (destination, local expert, token). Receivers place rows so that inside one (local expert,
source rank) block tokens ascend, so combine returns rows in exactly this order and the source reduces them
without any metadata. A row is one token copy per destination rank (the receiver expands it into one row per
local expert it is for) or one per pair when its encoding depends on the expert (smoothed int8 quant).
Rows are ordered by destination with this rank's own rows last: the remote rows are one contiguous send buffer."""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels as cpu_kernels


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

    @property
    def num_remote_rows(self) -> int:
        return int(self.row_token.numel()) - self.rows_per_dest[self.rank]


# fmt: off
def make_plan(
    token: torch.Tensor, slot: torch.Tensor, dest: torch.Tensor, expert: torch.Tensor, *, num_tokens: int,
    num_ranks: int, rank: int, num_local_experts: int, per_pair_rows: bool,
) -> Plan:
    # fmt: on
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


def plan_topk(topk_idx: torch.Tensor, *, num_local_experts: int, num_ranks: int, rank: int, mask: torch.Tensor,
              per_pair_rows: bool) -> Plan:  # fmt: skip
    """The plan of the valid entries of ``topk_idx`` `[T, K]` (validated ids; -1: none): pair (t, k) goes to rank
    ``e // L``, local expert ``e % L``; ranks masked in ``mask`` `[R]` (shrink mode) receive nothing, and a masked
    rank sends nothing. Without ``per_pair_rows`` the plan also holds its rows' ``slot_expert`` table."""
    ids, nl = topk_idx.long(), num_local_experts
    if (fast := cpu_kernels.plan(ids, nl, num_ranks, rank, mask, per_pair_rows)) is not None:
        token, slot, dest, expert, pairs, row_token, row_of_pair, rows, table = fast
        return Plan(token, slot, dest, expert, pairs, row_token, row_of_pair, rows, rank, table)
    valid = ids >= 0
    if bool(mask.any()):
        valid &= (mask.to(ids.device)[ids.clamp(min=0) // nl] == 0) & (not int(mask[rank]))
    token, slot = valid.nonzero(as_tuple=True)
    e = ids[token, slot]
    return make_plan(token, slot, e // nl, e % nl, num_tokens=len(ids), num_ranks=num_ranks, rank=rank,
                     num_local_experts=nl, per_pair_rows=per_pair_rows)  # fmt: skip
