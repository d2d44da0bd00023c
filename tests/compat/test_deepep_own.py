"""DeepEP's own normal-mode tests, run as DeepEP wrote them (``tests/vendor/deepep``, verbatim; the harness:
:mod:`tests.support.deepep_vendor`) on ``deep_ep_npu.Buffer``: ``test_intranode.py`` at 2 and 4 ranks, and
``test_internode.py`` on 2 simulated hosts x 2 ranks, small shapes. Their checks (received rows and counts against
their own layout, cached handles, ``num_worst_tokens``, async, fp8, combine with bias) are DeepEP's; their tuning
loops time our calls with CPU clocks."""

from __future__ import annotations

import pytest

from tests.support import deepep_vendor, hosts
from tests.support.distributed import parallel_launch

INTRANODE = dict(num_tokens=64, hidden=256, num_topk=4, num_experts=16, allow_mnnvl=False)
INTERNODE = dict(
    num_tokens=48,
    hidden=256,
    num_topk=4,
    num_topk_groups=2,
    num_experts=16,
    pressure_test_mode=0,
    test_ll_compatibility=False,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_test_intranode(world_size):
    assert all(parallel_launch(world_size, deepep_vendor.run, "test_intranode", INTRANODE, world_size, timeout=600))


@pytest.mark.slow
@pytest.mark.skipif(bool(why := hosts.unavailable()), reason=why or "-")
def test_deepep_test_internode_two_hosts():
    sim = hosts.SimulatedHosts(2)
    try:
        assert all(hosts.launch(sim, 2, deepep_vendor.run, "test_internode", INTERNODE, 2, timeout=600))
    finally:
        sim.close()


LOW_LATENCY = dict(
    num_tokens=8,
    hidden=1024,  # (UE8M0: 2 scale words per row)
    num_topk=3,
    num_experts=4,
    allow_mnnvl=False,
    disable_nvlink=False,
    use_logfmt=False,
    shrink_test=False,
    pressure_test=False,
)


def _low_latency(info, static: bool) -> bool:
    """DeepEP's ``test_low_latency.py``; ``static``: on the collective transport with the value checks and the CPU
    kernels off (the Buffer's static round, :mod:`deep_ep_npu.engine.static_masked`), else as a user runs it."""
    import contextlib
    import os

    import torch.distributed as dist

    from deep_ep_npu import envs, kernels

    if static:
        os.environ.update(DEEP_EP_NPU_CHECK_VALUES="0", DEEP_EP_NPU_TRANSPORT="collective")
        envs.check_values.cache_clear()
    gather = dist.all_gather_into_tensor  # (gloo wants the output as [R * rows, ...], NCCL also takes [R, rows, ...])
    dist.all_gather_into_tensor = lambda out, inp, **kw: gather(out.view(-1, *inp.shape[1:]), inp, **kw)
    try:
        with kernels.disabled() if static else contextlib.nullcontext():
            return deepep_vendor.run(info, "test_low_latency", LOW_LATENCY, 8)
    finally:
        dist.all_gather_into_tensor = gather


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepep_test_low_latency_on_the_static_round():
    """DeepEP's low-latency test (its checks of every received row, count, hash and combined row, bf16 / fp8 /
    UE8M0, hooks) on the Buffer's static round (~4 min on 2 loaded cores: slow)."""
    assert all(parallel_launch(2, _low_latency, True, timeout=900))
