"""DeepEP's shrink scenario at its own size (W 6): each rank's seeded inputs, one low-latency step on a Buffer, and
the single-process oracle of what a rank gets with some ranks masked. Experts are per-expert scalings (global expert
e multiplies its rows by ``1 + e / 8``), so a row reduced with another slot's weight is caught."""

from __future__ import annotations

import torch

from deep_ep_npu import Buffer
from tests.support.tokens import routed_tokens

W, N, HIDDEN, TOPK, EXPERTS = 6, 8, 128, 3, 12
L = EXPERTS // W
TIMEOUT = 2.0


def inputs(rank: int, step: int):
    """Rank ``rank``'s tokens (bf16), top-k ids and weights of call ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return routed_tokens(g, N - (rank + step) % 4, HIDDEN, TOPK, EXPERTS, scale=4)


def scale(expert: torch.Tensor) -> torch.Tensor:
    """What global expert ``expert`` multiplies its rows by."""
    return 1.0 + expert.float() / 8.0


def oracle(rank: int, step: int, masked: set[int]):
    """``recv_count`` `[L]` of ``rank`` and its combined `[T, HIDDEN]`, the ``masked`` ranks' experts absent."""
    counts = torch.zeros(L, dtype=torch.int32)
    for src in sorted(set(range(W)) - masked):
        idx = inputs(src, step)[1]
        counts += torch.bincount(idx[idx // L == rank].flatten() - rank * L, minlength=L).to(torch.int32)
    x, idx, w = inputs(rank, step)
    keep = torch.tensor([[int(e) // L not in masked for e in row] for row in idx]).view(idx.shape)
    y = (x.float().unsqueeze(1) * scale(idx).unsqueeze(2)).to(torch.bfloat16).float()
    return counts, (y * (w * keep).unsqueeze(2)).sum(1).to(torch.bfloat16)


def run_step(buf: Buffer, rank: int, step: int):
    """One dispatch -> experts -> combine of ``rank``'s call ``step``: its ``recv_count`` and combined x."""
    x, idx, w = inputs(rank, step)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
    experts = scale(torch.arange(L) + rank * L).view(L, 1, 1)
    combined, _, _ = buf.low_latency_combine((recv_x.float() * experts).to(recv_x.dtype), idx, w, handle)
    buf.clean_low_latency_buffer(N, HIDDEN, EXPERTS)  # barriers: a leaver's destroy() is one too, not this one
    return recv_count.clone(), combined.clone()


def check(rank: int, step: int, masked: set[int], counts: torch.Tensor, combined: torch.Tensor) -> None:
    """:func:`run_step`'s results against the oracle's with the ``masked`` ranks absent: the counts exactly, the
    combined x within 1e-2 of its largest value."""
    want_counts, want = oracle(rank, step, masked)
    assert torch.equal(counts, want_counts), (step, counts, want_counts)
    err = (combined.float() - want.float()).abs().max().item()
    assert err <= 1e-2 * max(1.0, want.float().abs().max().item()), (step, err)


def masked_ranks(buf: Buffer) -> list[int]:
    """The ranks ``buf``'s mask buffer holds as masked."""
    mask = torch.zeros(W, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(mask)
    return mask.nonzero().flatten().tolist()
