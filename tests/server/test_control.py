"""The per-step control messages of a torchrun job (:mod:`server.runtime.control`): each rank receives its own
message and nothing else (a rank's traffic is its plan's size, whatever the others' plans weigh)."""

from __future__ import annotations

import pickle

from tests.distributed import parallel_launch


def _exchange(info):
    import torch.distributed as dist

    from server.runtime import control

    received = []
    original = dist.recv

    def counting_recv(tensor, *args, **kwargs):  # what this rank takes in
        received.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.recv = counting_recv
    got = []
    for step in range(3):
        plans = {r: ("step", [r] * (10 if r == 1 else 10_000) + [step]) for r in range(info.world_size)}
        if info.rank == 0:
            control.send_each(info.group, plans)
            got.append(plans[0])
        else:
            got.append(control.receive_own(info.group))
        replies = control.gather_replies(info.group, ("ok", info.rank * 10 + step), info.world_size, info.rank)
        got.append(replies)
    return got, sum(received)


def test_each_rank_receives_only_its_own_plan():
    results = parallel_launch(3, _exchange, timeout=60)
    for rank, (got, _) in enumerate(results):
        for step in range(3):
            assert got[2 * step] == ("step", [rank] * (10 if rank == 1 else 10_000) + [step])
            assert got[2 * step + 1] == ([("ok", r * 10 + step) for r in range(3)] if rank == 0 else None)
    own = len(pickle.dumps(("step", [1] * 10 + [0])))
    assert results[1][1] <= 3 * (own + 8 + 8), "rank 1 took in more than its own plans"  # (+ length word, slack)
