"""The control messages of a ``torchrun`` job, point to point over its gloo control group: rank 0 sends each rank
only its own message (:func:`send_each`: a step's plan, pickled: its length, then its bytes), so a step's control
traffic into a rank is what that rank needs, not every rank's plans; each rank sends its reply to rank 0 alone
(:func:`send_own`), and rank 0 waits for the replies at most a timeout (:func:`receive_each`: a rank that is gone or
unreachable is reported, never waited for past the bound). Verdicts and heartbeats go through the job's store
instead (:mod:`.job_store`), whatever became of a rank's connection to rank 0."""

from __future__ import annotations

import functools
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from server.runtime.workers.heartbeat import PATIENCE, STALE_S

_LENGTH_TAG, _BODY_TAG = 1, 2


def _post(group: Any, peer: int, message: Any) -> list[Any]:
    """Start sending ``message`` to group rank ``peer``: its works and tensors (kept alive until done)."""
    import torch.distributed as dist

    body = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    length = torch.tensor([body.numel()], dtype=torch.int64)
    dst = dist.get_global_rank(group, peer)
    return [
        dist.isend(length, dst, group=group, tag=_LENGTH_TAG),
        dist.isend(body, dst, group=group, tag=_BODY_TAG),
        length,
        body,
    ]


class Late(RuntimeError):
    """A send or receive did not complete in time (it is left pending: gloo's own timeout would close every
    connection of the group, the live ranks' too)."""


class _Waiter:
    """``work.wait()`` in a helper thread: :meth:`wait` may give up and try again (gloo's own timeout would close
    every connection of the group, the live ranks' too)."""

    def __init__(self, work: Any) -> None:
        self.done, self.error = threading.Event(), list[RuntimeError]()
        threading.Thread(target=self._run, args=(work,), name="control-wait", daemon=True).start()

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            self.error.append(err)
        finally:
            self.done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the work completed within ``timeout`` seconds (its error raised)."""
        if not self.done.wait(max(0.0, timeout)):
            return False
        if self.error:
            raise self.error[0]
        return True


def _wait(work: Any, deadline: float | None, beating: Callable[[], bool] | None = None, cap: float = 0.0) -> None:
    """Wait for ``work`` until ``deadline`` (monotonic; None: as long as it takes); :class:`Late` past it, unless
    ``beating()`` (the peer's heartbeat): then on, a second at a time, until ``cap``. Its heartbeat is first looked
    at :data:`~.heartbeat.STALE_S` before ``deadline``, so one that stopped is known stale at ``deadline``."""
    if work is None:
        return
    if deadline is None:
        work.wait()
        return
    waiter = _Waiter(work)
    if beating is not None:
        if waiter.wait(deadline - STALE_S - time.monotonic()):
            return
        beating()
    while not waiter.wait(deadline - time.monotonic()):
        if beating is None or time.monotonic() >= cap or not beating():
            raise Late("not completed in time")
        deadline = min(cap, time.monotonic() + 1.0)


def post_each(group: Any, messages: dict[int, Any]) -> tuple[dict[int, list[Any]], dict[int, str]]:
    """Rank 0: start sending ``messages[r]`` to each rank ``r`` (group ranks > 0); the sends in flight (finish them
    with :func:`finish_sends`) and the ranks that could not be sent to, with why."""
    posted, failed = {}, {}
    for rank, message in messages.items():
        try:
            posted[rank] = _post(group, rank, message)
        except RuntimeError as err:
            failed[rank] = f"rank {rank} is unreachable ({str(err).splitlines()[0]})"
    return posted, failed


def finish_sends(posted: dict[int, list[Any]], timeout: float) -> dict[int, str]:
    """Wait at most ``timeout`` seconds for the sends of :func:`post_each`; the ranks whose send did not complete
    (a rank that does not take its message: gone, cut off, stopped), with why."""
    deadline, failed = time.monotonic() + timeout, {}
    for rank, (length_work, body_work, *_) in posted.items():
        try:
            _wait(length_work, deadline)
            _wait(body_work, deadline)
        except RuntimeError as err:
            failed[rank] = f"rank {rank} is unreachable ({str(err).splitlines()[0]})"
    return failed


def send_each(group: Any, messages: dict[int, Any], timeout: float) -> dict[int, str]:
    """Rank 0: send ``messages[r]`` to each rank ``r`` (group ranks > 0), all bounded by ``timeout`` seconds; the
    ranks it could not send to, with why."""
    posted, failed = post_each(group, messages)
    return failed | finish_sends(posted, timeout)


def _receive(
    group: Any, src: int, deadline: float | None, beating: Callable[[], bool] | None = None, cap: float = 0.0
) -> Any:
    import torch.distributed as dist

    source = dist.get_global_rank(group, src)
    length = torch.empty((1,), dtype=torch.int64)
    _wait(dist.irecv(length, source, group=group, tag=_LENGTH_TAG), deadline, beating, cap)
    body = torch.empty((int(length[0]),), dtype=torch.uint8)
    _wait(dist.irecv(body, source, group=group, tag=_BODY_TAG), deadline, beating, cap)
    return pickle.loads(body.numpy().tobytes())


def receive_own(group: Any, verdict: Callable[[], str] | None = None, poll_s: float = 1.0) -> Any:
    """A rank > 0: its next message from rank 0 (:func:`send_each`); waits as long as it takes, asking ``verdict()``
    every ``poll_s`` seconds meanwhile: a non-empty answer (rank 0 gave up on this rank) raises :class:`Late`."""
    import torch.distributed as dist

    if verdict is None:
        return _receive(group, 0, None)
    length = torch.empty((1,), dtype=torch.int64)
    waiter = _Waiter(dist.irecv(length, dist.get_global_rank(group, 0), group=group, tag=_LENGTH_TAG))
    while not waiter.wait(poll_s):
        if why := verdict():
            raise Late(why)
    body = torch.empty((int(length[0]),), dtype=torch.uint8)
    _wait(dist.irecv(body, dist.get_global_rank(group, 0), group=group, tag=_BODY_TAG), None)
    return pickle.loads(body.numpy().tobytes())


def send_own(group: Any, message: Any, timeout: float) -> None:
    """A rank > 0: send ``message`` to rank 0 (:func:`receive_each`), at most ``timeout`` seconds (:class:`Late`:
    rank 0 did not take it, it is gone, cut off or gave up on this rank)."""
    deadline = time.monotonic() + timeout
    for work in _post(group, 0, message)[:2]:
        _wait(work, deadline)


def receive_each(
    group: Any, ranks: list[int], timeout: float, beating: Callable[[int], bool] | None = None
) -> tuple[dict[int, Any], dict[int, str]]:
    """Rank 0: the next message of each of ``ranks`` (group ranks > 0) within ``timeout`` seconds (a rank for which
    ``beating(rank)`` holds is waited for longer: :data:`~.heartbeat.PATIENCE` times ``timeout``); the ranks that
    sent none (gone, unreachable, hung or too slow), with why."""
    start = time.monotonic()
    deadline, cap, replies, failed = start + timeout, start + PATIENCE * timeout, {}, {}
    for rank in ranks:
        alive = None if beating is None else functools.partial(beating, rank)
        try:
            replies[rank] = _receive(group, rank, deadline, alive, cap)
        except RuntimeError as err:
            what = str(err).splitlines()[0]
            took = time.monotonic() - start
            late = f"rank {rank} did not answer within {timeout:.3g}s"
            if beating is not None:
                late += " (its heartbeat stopped)" if took < PATIENCE * timeout else " (still beating)"
            failed[rank] = late if took >= timeout else f"rank {rank}: {what}"
    return replies, failed
