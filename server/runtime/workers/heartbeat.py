"""Heartbeats: a worker slowed by load is not taken for a hung or lost one while it still beats.

Every worker runs a daemon thread that beats every :data:`BEAT_S` seconds (:func:`start_beating`): spawned workers
write the time into a shared value, torchrun ranks bump a counter in the job's store (their clocks may differ). The
driver, when a worker has not answered within the step's bound, asks whether it beat in the last :data:`STALE_S`
seconds (the time, or :class:`Pulse` for a counter): if so it waits on (at most :data:`PATIENCE` times the bound in
all, so a worker that beats but never answers still fails the step), else the worker is hung (SIGSTOP), dead or cut
off, and is declared so at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

BEAT_S = 0.2
"""How often a worker beats."""

STALE_S = 2.0
"""A worker whose counter did not move for this long is not beating (the thread of a busy process runs well within
it; one stopped, dead or cut off never does)."""

PATIENCE = 4
"""A late worker that still beats is waited for up to this many times the step's bound, then fails it all the same."""


def start_beating(write: Callable[[int], None]) -> Callable[[], None]:
    """Start this worker's heartbeat thread: ``write(n)`` with n = 1, 2, ... every :data:`BEAT_S` seconds (a failing
    write is skipped: the driver then sees no beat). Returns ``stop()``: the thread ends and is joined (call it
    before the process tears down what ``write`` uses; a write in progress is waited for up to ``stop_s``)."""
    stopping = threading.Event()

    def run() -> None:
        n = 0
        while not stopping.is_set():
            n += 1
            with contextlib.suppress(Exception):
                write(n)
            stopping.wait(BEAT_S)

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()

    def stop(stop_s: float = 5.0) -> None:
        stopping.set()
        thread.join(stop_s)

    return stop


class Pulse:
    """The driver's view of the workers' heartbeats: ``read(rank)`` returns a worker's counter (None: unreadable)."""

    def __init__(self, read: Callable[[int], int | None]) -> None:
        self.read = read
        self.seen: dict[int, tuple[int | None, float]] = {}  # rank -> (counter, when it was seen to move)

    def beating(self, rank: int) -> bool:
        """Whether ``rank``'s counter moved within the last :data:`STALE_S` seconds (as far as this driver has
        looked: the first look counts as a move)."""
        value, now = self.read(rank), time.monotonic()
        last = self.seen.get(rank)
        if last is None or (value is not None and value != last[0]):
            self.seen[rank] = (value, now)
            return True
        return now - last[1] < STALE_S
