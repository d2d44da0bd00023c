"""Two-batch overlap (SGLang's TBO, ``EngineConfig.two_batch_overlap``): a step of EP > 1 runs as two micro-batches
of its sequences, so that one micro-batch's MoE exchange travels while the other's dense part runs.

Per MoE layer: micro-batch A's residual add + attention + router, A's dispatch sent; the same for B (A's rows travel
meanwhile); both receives; the experts **once** on the rows of both (each expert's rows of A, then of B: a decode step
on the CPU is bound by reading the expert weights, and two expert passes would read them twice), A's and B's combines
sent; then, in the next layer, A's combine received and A's dense part run while B's combine travels. So the waits of
A's dispatch and B's combine overlap dense work; those of B's dispatch and A's combine do not. The price: the dense
weights (attention projections, dense MLPs) are read once per micro-batch. Every rank makes the same calls in the same
order (two dispatches and two combines per MoE layer; a micro-batch may have no tokens): whether a step splits
depends only on the step's tokens over all ranks (:func:`micro_batches`). The library's Buffer keeps two calls in
flight (``return_recv_hook``); this order never has more.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .forward_batch import ForwardBatch, SeqInput

if TYPE_CHECKING:
    from .moe import SparseMoE

MIN_TOKENS = 16
"""The step's tokens over all ranks from which it runs as two micro-batches (at decode: batch 16, 8 a rank at EP 2)."""

Receive = Callable[[], torch.Tensor]
_T = TypeVar("_T")


def micro_batches(
    seqs: Sequence[SeqInput], block_size: int, device: torch.device | str, num_tokens_all_ranks: int
) -> tuple[ForwardBatch, ForwardBatch] | None:
    """``seqs`` (a step's, in row order) as two batches, split where their tokens halve, or None when the step has
    fewer than :data:`MIN_TOKENS` tokens over all ranks (the same answer on every rank)."""
    if num_tokens_all_ranks < MIN_TOKENS:
        return None
    total, run, k = sum(len(s.token_ids) for s in seqs), 0, 0
    while k < len(seqs) and 2 * run < total:
        run, k = run + len(seqs[k].token_ids), k + 1
    return tuple(ForwardBatch.build(part, block_size, device, num_tokens_all_ranks) for part in (seqs[:k], seqs[k:]))  # type: ignore[return-value]


def _timed(stats: Any, name: str, call: Callable[[], _T]) -> _T:
    t0 = time.perf_counter()
    out = call()
    setattr(stats, name, getattr(stats, name) + time.perf_counter() - t0)
    return out


class Routed:
    """One micro-batch between its dispatch's send and its combine's send."""

    def __init__(self, moe: SparseMoE, h: torch.Tensor, num_tokens_all_ranks: int) -> None:
        logical, self.topk_weights = getattr(moe, moe.router_name)(h)
        self.h, self.topk_idx = h, moe.comm.to_physical(moe.moe_index, logical)
        start = lambda: moe.comm.dispatch_start(h, self.topk_idx, num_tokens_all_ranks)  # noqa: E731
        self.receive: Callable[[], tuple[torch.Tensor, torch.Tensor, Any]] = _timed(moe.comm.stats, "dispatch", start)


def merge(
    parts: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Two grouped layouts (received rows `[n_i, hidden]`, offsets `[L]` `torch.int32`, rows past ``offsets[-1]``
    padding) as one of ``num_rows`` rows (at least the valid rows of both): each expert's rows of the first part, then
    of the second. Returns the rows `[num_rows, hidden]`, the offsets `[L]` `torch.int32`, and per part `[n_i]`
    `torch.int64` the merged row of each of its rows (padding rows: 0), to take each part's expert outputs back."""
    counts = [torch.diff(offsets, prepend=offsets.new_zeros(1)) for _, offsets in parts]
    offsets = torch.cumsum(counts[0] + counts[1], 0, dtype=torch.int32)
    before = offsets - counts[0] - counts[1]  # each expert's first merged row
    merged = parts[0][0].new_empty(num_rows + 1, parts[0][0].shape[1])  # (the last row: padding's scratch)
    wheres = []
    for (rows, own), count in zip(parts, counts, strict=True):
        row = torch.arange(rows.shape[0], device=rows.device)
        expert = torch.searchsorted(own, row, right=True).clamp_(max=own.shape[0] - 1)
        valid = row < own[-1]
        dst = before[expert] + row - (own - count)[expert]
        merged.index_copy_(0, torch.where(valid, dst, num_rows), rows)
        wheres.append(torch.where(valid, dst, 0))
        before = before + count
    return merged[:num_rows], offsets, wheres


def experts(moe: SparseMoE, routed: list[Routed], num_tokens_all_ranks: int) -> list[Receive]:
    """Both micro-batches' receives, the experts once on their rows, both combines sent (the shared experts computed
    while they travel); returns each micro-batch's combine receive (the MoE output `[num_tokens, hidden]`)."""
    comm = moe.comm
    received = [_timed(comm.stats, "dispatch", r.receive) for r in routed]
    bound = num_tokens_all_ranks * min(routed[0].topk_idx.shape[1], comm.num_local_experts)
    num_rows = min(sum(got[0].shape[0] for got in received), bound)
    rows, offsets, wheres = merge([(got[0], got[1]) for got in received], num_rows)
    out = moe.experts(rows, offsets)
    comm.record_load(moe.moe_index, moe.num_moe_layers, offsets)
    receives = []
    for r, got, where in zip(routed, received, wheres, strict=True):
        send = functools.partial(comm.combine_start, out.index_select(0, where), r.topk_idx, r.topk_weights, got[2])
        receives.append(_timed(comm.stats, "combine", send))
    shared = [moe._shared(r.h) if moe.shared_name is not None else None for r in routed]

    def done(receive: Receive, extra: torch.Tensor | None) -> Receive:
        def call() -> torch.Tensor:
            combined = _timed(comm.stats, "combine", receive)
            return combined if extra is None else combined + extra

        return call

    return [done(receive, extra) for receive, extra in zip(receives, shared, strict=True)]
