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
