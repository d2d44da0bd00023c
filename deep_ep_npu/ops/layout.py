"""Send plans: which (token, slot) pairs go to which (rank, local expert), in the order the receiver stores them.

Pairs are sorted by (destination rank, local expert, token). The receiver stores rows expert-major, then source
rank, then token, so a stable sort of the concatenated per-source blocks by (expert, source) yields the final
order, and combine can send rows back in exactly the order the source expects (no metadata needed).
"""

from __future__ import annotations

import dataclasses

import torch


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
