"""The control messages of a torchrun job (:mod:`server.runtime.workers.control`): each rank receives its own
message and nothing else (a rank's traffic is its plan's size, whatever the others' plans weigh); rank 0 receives
each rank's reply, and a rank that sends none is reported within the timeout instead of waited for."""

from __future__ import annotations

import pickle
import time

from tests.support.distributed import parallel_launch


def _exchange(info):
    import torch.distributed as dist

    from server.runtime.workers import control

    received = []
    original = dist.irecv

    def counting_irecv(tensor, *args, **kwargs):  # what this rank takes in
        received.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.irecv = counting_irecv
    got = []
    for step in range(3):
        plans = {r: ("step", [r] * (10 if r == 1 else 10_000) + [step]) for r in range(1, info.world_size)}
        if info.rank == 0:
            assert control.send_each(info.group, plans, 10.0) == {}
            replies, failed = control.receive_each(info.group, [1, 2], 10.0)
            got.append((replies, failed))
        else:
            got.append(control.receive_own(info.group))
            control.send_own(info.group, ("ok", info.rank * 10 + step), 10.0)
    if info.rank == 0:  # rank 2 sends nothing more: reported after the timeout
        t0 = time.monotonic()
        replies, failed = control.receive_each(info.group, [1, 2], 1.0)
        got.append((replies, sorted(failed), time.monotonic() - t0))
    elif info.rank == 1:
        control.send_own(info.group, ("ok", "last"), 10.0)
    store = dist.distributed_c10d._get_default_store()  # (a timed-out pair is closed: no collective after it)
    if info.rank == 0:
        store.set("test/done", "1")
    else:
        store.wait(["test/done"])  # rank 2 stays until then: silent, not gone
    return got, sum(received)


def test_each_rank_receives_only_its_own_plan():
    results = parallel_launch(3, _exchange, timeout=60)
    for rank in (1, 2):
        got, _ = results[rank]
        assert got == [("step", [rank] * (10 if rank == 1 else 10_000) + [step]) for step in range(3)]
    zero, _ = results[0]
    assert zero[:3] == [({1: ("ok", 10 + step), 2: ("ok", 20 + step)}, {}) for step in range(3)]
    replies, failed, waited = zero[3]
    assert replies == {1: ("ok", "last")} and failed == [2] and 1.0 <= waited < 3.0
    own = len(pickle.dumps(("step", [1] * 10 + [0])))
    assert results[1][1] <= 3 * (own + 8 + 8), "rank 1 took in more than its own plans"  # (+ length word, slack)
