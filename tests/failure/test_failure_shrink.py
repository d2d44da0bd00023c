"""DeepEP's shrink scenario at its own size: ranks 1, 3 and 5 of 6 fail one after another, each by leaving the ops
for ``Buffer.destroy()`` (then staying alive until the survivors are done). The survivors (0, 2, 4) must find each
leaver missing at its first absent dispatch (a destroy is not a dispatch), mask it, and keep computing exactly the
results of the ranks that are left: their masks become {1}, {1, 3}, {1, 3, 5}. Every process exits cleanly
afterwards (exit code 0, no hang at interpreter exit). On both transports.

Oracle: single-process, from every rank's seeded inputs (:mod:`tests.support.shrink`)."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from deep_ep_npu import Buffer
from tests.support import shrink
from tests.support.distributed import leave_together, parallel_launch

LEAVERS = {1: 1, 2: 3, 3: 5}  # step -> the rank that leaves before it


def _rank(info, transport: str):
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer(info.group, enable_shrink=True, timeout=shrink.TIMEOUT, explicitly_destroy=True, transport=transport)
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
        counts, combined = shrink.run_step(buf, info.rank, step)
        out["elapsed"].append(round(time.monotonic() - t0, 3))
        shrink.check(info.rank, step, masked, counts, combined)
        out["masks"].append(shrink.masked_ranks(buf))
    leave_together(store, info.rank, shrink.W - len(LEAVERS))
    buf.destroy()
    return out


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_deepep_shrink_scenario_three_leavers_of_six(transport: str):
    leavers = tuple(LEAVERS.values())
    results = parallel_launch(shrink.W, _rank, transport, timeout=120, allow_exit=leavers, require_clean_exit=True)
    for rank in (0, 2, 4):
        assert results[rank]["masks"] == [[], [1], [1, 3], [1, 3, 5]], (rank, results[rank])
        # each leaver is found at the timeout (it stopped calling: a hang), not at a second timeout (which a leaver
        # counted as arrived, then silent, would take)
        assert all(t < shrink.TIMEOUT + 1.3 for t in results[rank]["elapsed"]), results[rank]["elapsed"]
