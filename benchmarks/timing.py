"""Interleaved timing shared by the benchmarks: every implementation in every iteration, same-iteration ratios."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def time_interleaved(fns: list[Callable[[], object]], group, warmup: int, iters: int) -> list[list[float]]:
    """Per function, per iteration, its latency in µs, max over ranks, after ``warmup`` untimed rounds. The
    functions run interleaved, one after another in every iteration (each barrier-aligned), so background load hits
    them alike and same-iteration ratios can be taken; each iteration runs them in a fresh random order (seeded by
    the iteration: the same on every rank), so that none always follows the same one (what ran before decides
    what is still in the caches)."""
    times = torch.empty((len(fns), iters), dtype=torch.float64)
    for i in range(warmup + iters):
        order = list(range(len(fns)))
        random.Random(i).shuffle(order)
        for j in order:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fns[j]()
            if i >= warmup:
                times[j, i - warmup] = (time.perf_counter() - t0) * 1e6
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist()
