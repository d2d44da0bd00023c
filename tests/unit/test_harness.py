"""The multi-process harness itself: results in rank order, exceptions and deadlocks fail fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import parallel_launch


def _sum_ranks(info, scale):
    t = torch.tensor([float(info.rank)])
    dist.all_reduce(t, group=info.group)
    return info.rank, t.item() * scale


def _raise_on_rank_one(info):
    if info.rank == 1:
        raise ValueError("boom on rank one")
    return info.rank


def _hang_on_rank_zero(info):
    if info.rank == 0:
        time.sleep(60)
    return info.rank


def test_results_in_rank_order():
    assert parallel_launch(3, _sum_ranks, 2.0) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_rank_exception_reported_with_traceback():
    with pytest.raises(RuntimeError, match="boom on rank one"):
        parallel_launch(2, _raise_on_rank_one)


def test_hang_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\[0\]"):
        parallel_launch(2, _hang_on_rank_zero, timeout=3)
    assert time.monotonic() - t0 < 15
