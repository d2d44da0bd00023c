"""DeepEP's shrink scenario at its own size: ranks 1, 3 and 5 of 6 fail one after another, each by leaving the ops
for ``Buffer.destroy()`` (then staying alive until the survivors are done). The survivors (0, 2, 4) must find each
leaver missing at its first absent dispatch (a destroy is not a dispatch), mask it, and keep computing exactly the
results of the ranks that are left: their masks become {1}, {1, 3}, {1, 3, 5}. Every process exits cleanly
afterwards (exit code 0, no hang at interpreter exit). On both transports.

Oracle: single-process, from every rank's seeded inputs; experts are per-expert scalings (global expert e multiplies
its rows by ``1 + e / 8``), so a row reduced with another slot's weight is caught."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer
from tests.support.distributed import leave_together, parallel_launch

W, N, HIDDEN, TOPK, EXPERTS = 6, 8, 128, 3, 12
L = EXPERTS // W
TIMEOUT = 2.0
LEAVERS = {1: 1, 2: 3, 3: 5}  # step -> the rank that leaves before it


def _inputs(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    num_tokens = N - (rank + step) % 4
    x = (torch.randn((num_tokens, HIDDEN), generator=g) * 4).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(num_tokens)])
    return x, idx, torch.rand((num_tokens, TOPK), generator=g)


def _scale(expert: torch.Tensor) -> torch.Tensor:
    return 1.0 + expert.float() / 8.0


def _oracle(rank: int, step: int, masked: set[int]):
    """``recv_count`` `[L]` of ``rank`` and its combined `[T, HIDDEN]`, the ``masked`` ranks' experts absent."""
    counts = torch.zeros(L, dtype=torch.int32)
    for src in sorted(set(range(W)) - masked):
        idx = _inputs(src, step)[1]
        counts += torch.bincount(idx[idx // L == rank].flatten() - rank * L, minlength=L).to(torch.int32)
    x, idx, w = _inputs(rank, step)
    keep = torch.tensor([[int(e) // L not in masked for e in row] for row in idx]).view(idx.shape)
    y = (x.float().unsqueeze(1) * _scale(idx).unsqueeze(2)).to(torch.bfloat16).float()
    return counts, (y * (w * keep).unsqueeze(2)).sum(1).to(torch.bfloat16)


def _step(buf: Buffer, rank: int, step: int):
    x, idx, w = _inputs(rank, step)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
    experts = _scale(torch.arange(L) + rank * L).view(L, 1, 1)
    combined, _, _ = buf.low_latency_combine((recv_x.float() * experts).to(recv_x.dtype), idx, w, handle)
    buf.clean_low_latency_buffer(N, HIDDEN, EXPERTS)  # barriers: a leaver's destroy() is one too, not this one
    return recv_count.clone(), combined.clone()


def _rank(info, transport: str):
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer(info.group, enable_shrink=True, timeout=TIMEOUT, explicitly_destroy=True, transport=transport)
    masked: set[int] = set()
    out = {"masks": [], "elapsed": []}
    for step in range(4):
        if LEAVERS.get(step) == info.rank:
            buf.destroy()  # leaves the ops for good; alive until the survivors are done
            while not store.check(["test/done"]):
                time.sleep(0.05)
            os._exit(0)
        masked |= {LEAVERS[step]} if step in LEAVERS else set()
        t0 = time.monotonic()
        counts, combined = _step(buf, info.rank, step)
        out["elapsed"].append(round(time.monotonic() - t0, 3))
        want_counts, want = _oracle(info.rank, step, masked)
        assert torch.equal(counts, want_counts), (step, counts, want_counts)
        err = (combined.float() - want.float()).abs().max().item()
        assert err <= 1e-2 * max(1.0, want.float().abs().max().item()), (step, err)
        mask = torch.zeros(W, dtype=torch.int32)
        buf.low_latency_query_mask_buffer(mask)
        out["masks"].append(mask.nonzero().flatten().tolist())
    leave_together(store, info.rank, W - len(LEAVERS))
    buf.destroy()
    return out


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_deepep_shrink_scenario_three_leavers_of_six(transport: str):
    leavers = tuple(LEAVERS.values())
    results = parallel_launch(W, _rank, transport, timeout=120, allow_exit=leavers, require_clean_exit=True)
    for rank in (0, 2, 4):
        assert results[rank]["masks"] == [[], [1], [1, 3], [1, 3, 5]], (rank, results[rank])
        # each leaver is found at the timeout (it stopped calling: a hang), not at a second timeout (which a leaver
        # counted as arrived, then silent, would take)
        assert all(t < TIMEOUT + 1.3 for t in results[rank]["elapsed"]), results[rank]["elapsed"]
