"""A ``torchrun`` job's store as the server's side channel: heartbeats (rank > 0 -> rank 0) and verdicts (rank 0 ->
the rank it lost, or every rank: stop), each over a connection of its own (:class:`StoreLink`).

The process group's own store client is not used for these: a call on it blocks for the group's whole timeout
while the store's host cannot be reached, holding the client's lock (the rank's other calls wait behind it), and
after a cut its TCP connection may resume only at the kernel's next retransmission, minutes later. A link instead
bounds each call by its own short timeout and, after any failure, opens a fresh connection for the next call: a
rank whose link is back hears its verdict within a few seconds.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_PREFIX = "deep_ep_npu/server/"
_VERDICT = "verdict/"
_BEAT = "beat/"


def _tcp_store(store: Any) -> Any:
    """The ``TCPStore`` under ``store`` (the default group's store: prefix stores over torchrun's TCP store)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise TypeError(f"the job's store is a {type(store).__name__}; the server's torchrun mode needs a TCPStore")
    return store


class StoreLink:
    """This process's own connection to the job's TCP store (the one under ``store``), each call bounded by
    ``timeout_s``; a failed call returns None and the next call reconnects."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        tcp = _tcp_store(store)
        self.host, self.port, self.timeout_s = tcp.host, tcp.port, timeout_s
        self._client: Any = None
        self._lock = threading.Lock()  # (one call at a time on the connection)

    def call(self, op: Callable[[Any], T]) -> T | None:
        """``op(store)`` on this link's store (keys under the server's prefix), or None if it failed."""
        import torch.distributed as dist

        with self._lock:
            try:
                if self._client is None:
                    timeout = datetime.timedelta(seconds=self.timeout_s)
                    tcp = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)
                    self._client = dist.PrefixStore(_PREFIX, tcp)
                return op(self._client)
            except (RuntimeError, OSError):  # (DistError subclasses RuntimeError: unreachable, timed out, closed)
                self._client = None
                return None


def beat_in(link: StoreLink, rank: int) -> Callable[[int], None]:
    """A rank > 0's heartbeat writer (:func:`~.heartbeat.start_beating`): its counter on ``link``."""
    return lambda n: link.call(lambda s: s.set(f"{_BEAT}{rank}", str(n)))


def read_beat(link: StoreLink, rank: int) -> int | None:
    """Rank 0: ``rank``'s heartbeat counter (None: none yet, or unreadable)."""
    key = f"{_BEAT}{rank}"
    return link.call(lambda s: int(s.get(key)) if s.check([key]) else None)


def post_verdict(link: StoreLink, ranks: list[int], why: str, tries: int = 3) -> None:
    """Rank 0: tell ``ranks`` (group ranks > 0) that they are out (``why``; "": the job stops), trying each up to
    ``tries`` times (the store is rank 0's node's own: a failure is a passing one)."""

    def post(store: Any, key: str) -> bool:
        store.set(key, why)
        return True

    for rank in ranks:
        key = f"{_VERDICT}{rank}"
        for _ in range(tries):
            if link.call(functools.partial(post, key=key)):
                break


def read_verdict(link: StoreLink, rank: int) -> str | None:
    """Rank 0's verdict on ``rank`` ("": stop; a reason: lost), or None (none yet, or the store cannot be
    reached)."""
    key = f"{_VERDICT}{rank}"
    return link.call(lambda s: s.get(key).decode() if s.check([key]) else None)


def wait_verdict(link: StoreLink, rank: int, poll_s: float = 0.2) -> str:
    """A rank > 0 whose step failed: wait for rank 0's verdict on it (a cut-off rank learns it once its link is
    back: each try reconnects after a failed one)."""
    while (why := read_verdict(link, rank)) is None:
        time.sleep(poll_s)
    return why
