"""Fault injection for the elastic-mode tests. Python imports this module at start-up in every process whose
``PYTHONPATH`` lists this folder (a server, its forkserver and workers, torchrun's ranks): with
``DEEP_EP_NPU_TEST_FAULTS`` = ``RANK:POINT:N[,RANK:POINT:N...]`` set, the process of EP rank RANK kills itself
(SIGKILL: it says goodbye to no one) on its N-th pass through POINT:

- ``dispatch`` / ``combine`` / ``regroup``: :class:`server.models.buffer_comm.BufferComm`'s method of that name (a
  rank lost mid-step, or while the survivors regroup after a first loss);
- ``move``: :func:`server.runtime.workers.rebalance.move_expert_weights` (a rank lost while EPLB moves expert
  weights; one call per MoE layer).

Without the variable it does nothing (and imports nothing)."""

import os

SPEC = os.environ.get("DEEP_EP_NPU_TEST_FAULTS", "")


def _install(spec: str) -> None:
    import functools
    import signal

    from server.models import buffer_comm
    from server.runtime.workers import rebalance

    faults = {(int(rank), point): int(n) for rank, point, n in (item.split(":") for item in spec.split(","))}
    counts: dict[str, int] = {}

    def passing(rank: int, point: str) -> None:
        if (rank, point) in faults:
            counts[point] = counts.get(point, 0) + 1
            if counts[point] == faults[rank, point]:
                os.kill(os.getpid(), signal.SIGKILL)

    def method(point: str):  # noqa: ANN202
        plain = getattr(buffer_comm.BufferComm, point)

        @functools.wraps(plain)
        def wrapped(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            passing(self.rank, point)
            return plain(self, *args, **kwargs)

        return wrapped

    for point in ("dispatch", "combine", "regroup"):
        setattr(buffer_comm.BufferComm, point, method(point))
    plain_move = rebalance.move_expert_weights

    @functools.wraps(plain_move)
    def move(tensors, old, new, rank, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        passing(rank, "move")
        return plain_move(tensors, old, new, rank, *args, **kwargs)

    rebalance.move_expert_weights = move


if SPEC:
    _install(SPEC)
