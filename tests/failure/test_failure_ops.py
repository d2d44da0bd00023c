"""Failure detection below the Buffer: the ops' collectives are bounded too (``DEEP_EP_NPU_TIMEOUT``), the survivors
agree on one missing set (a rank that arrives too late learns it was excluded), and the timeout settings are
validated (Buffer ``timeout=``, the environment variable)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer, EPRankFailure, envs, kernels
from deep_ep_npu import ops as ep_ops
from deep_ep_npu.transports.failure import DEFAULT_TIMEOUT_S, resolve_timeout
from tests.support.distributed import leave_together, parallel_launch, stop_victim
from tests.support.tokens import routed_tokens

N, H, E, K = 4, 64, 6, 2


def _inputs(rank: int):
    x, ids, w = routed_tokens(torch.Generator().manual_seed(rank), N, H, K, E)
    return x, ids.to(torch.int32), w


def _ops_round(info, stop_before: str | None = None):
    x, ids, w = _inputs(info.rank)
    args = (info.group, info.world_size, info.rank, E)
    if stop_before == "dispatch":
        return None
    expand_x, _, assist, _, counts, _, _ = ep_ops.moe_distribute_dispatch_v2(x, ids, *args)
    if stop_before == "combine":
        return None
    return ep_ops.moe_distribute_combine_v2(expand_x, ids, assist, counts, w, *args)


def _ops_failure(info, where: str, how: str, victim: int, static: bool = False):
    os.environ["DEEP_EP_NPU_TIMEOUT"] = "1.5"  # read when the group's EPGroup is created (first op call)
    if static:  # checks off, the torch code: the ops' static round (deep_ep_npu.engine.static_flat)
        os.environ["DEEP_EP_NPU_CHECK_VALUES"] = "0"
        envs.check_values.cache_clear()
        kernels.disabled().__enter__()  # (this rank process's whole life)
    store = dist.distributed_c10d._get_default_store()
    _ops_round(info)
    if info.rank == victim:
        _ops_round(info, stop_before=where)
        stop_victim(store, how)
    t0 = time.monotonic()
    try:
        _ops_round(info)
        out = None
    except EPRankFailure as err:
        out = (err.missing_ranks, err.excluded, time.monotonic() - t0, str(err))
    leave_together(store, info.rank, info.world_size - 1)
    return out


@pytest.mark.parametrize(
    ("where", "how", "static"), [("dispatch", "exit", False), ("combine", "hang", False), ("combine", "exit", True)]
)
def test_ops_raise_naming_the_missing_rank(where, how, static):
    results = parallel_launch(3, _ops_failure, where, how, 1, static, timeout=60, allow_exit=(1,))
    for rank in (0, 2):
        missing, excluded, elapsed, message = results[rank]
        assert missing == (1,) and not excluded, results[rank]
        assert elapsed < 2 * 1.5 + 1.5 and "ranks [1]" in message


def _late_rank(info):
    """Rank 2 calls 2.5 s late with a 1 s timeout: ranks 0 and 1 name it; it learns that it was excluded."""
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer(info.group, timeout=1.0)
    x, ids, w = _inputs(info.rank)
    if info.rank == 2:
        time.sleep(2.5)
    try:
        buf.low_latency_dispatch(x, ids.long(), N, E, use_fp8=False)
        out = None
    except EPRankFailure as err:
        out = (err.missing_ranks, err.excluded)
    leave_together(store, info.rank, info.world_size)
    return out


def test_a_late_rank_learns_it_was_excluded():
    results = parallel_launch(3, _late_rank, timeout=60)
    assert results == [((2,), False), ((2,), False), ((2,), True)]


def _bad_timeout(info):
    errors = []
    for bad in (0, -1.0, float("inf"), float("nan"), "5", True):
        try:
            Buffer(info.group, timeout=bad)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_buffer_timeout_is_validated_before_any_communication():
    errors = parallel_launch(1, _bad_timeout, timeout=60)[0]
    assert len(errors) == 6 and all(e.startswith("timeout: must be a positive finite number") for e in errors)


def test_timeout_defaults_and_environment(monkeypatch):
    monkeypatch.delenv("DEEP_EP_NPU_TIMEOUT", raising=False)
    assert envs.timeout_s() is None and resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("DEEP_EP_NPU_TIMEOUT", "2.5")
    assert envs.timeout_s() == 2.5 and resolve_timeout(None) == 2.5 and resolve_timeout(7) == 7.0
    for bad in ("abc", "0", "-1", "inf", "nan"):
        monkeypatch.setenv("DEEP_EP_NPU_TIMEOUT", bad)
        with pytest.raises(ValueError, match="DEEP_EP_NPU_TIMEOUT: must be a positive number"):
            envs.timeout_s()


def _env_timeout(info):
    """DEEP_EP_NPU_TIMEOUT=1.5 (read when the Buffer is made): a peer that stops calling is reported after ~1.5 s."""
    os.environ["DEEP_EP_NPU_TIMEOUT"] = "1.5"
    buf = Buffer(info.group)
    store = dist.distributed_c10d._get_default_store()
    if info.rank == 1:
        stop_victim(store, "hang")
    x = torch.randn((N, H)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    t0 = time.monotonic()
    with pytest.raises(EPRankFailure) as err:
        buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    elapsed = time.monotonic() - t0
    leave_together(store, info.rank, 1)
    return elapsed, err.value.timeout, err.value.missing_ranks


def test_timeout_from_the_environment_is_honoured():
    """The default is the documented 30 s; a short one from the environment bounds a hang by it (plus the grace)."""
    assert DEFAULT_TIMEOUT_S == 30.0
    elapsed, timeout, missing = parallel_launch(2, _env_timeout, timeout=60, allow_exit=(1,))[0]
    assert timeout == 1.5 and missing == (1,) and 1.4 <= elapsed <= 1.5 + 1.0 + 1.0, elapsed
