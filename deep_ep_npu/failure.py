"""Failure detection: every collective deep_ep_npu issues has a bounded wait, and a rank that exits or stops calling
makes every other rank raise :class:`EPRankFailure` naming the missing ranks, within the timeout, never a hang.

How the missing ranks are named (torch.distributed's own c10d store; no extra transport):

- Before each collective on a group, a rank writes its collective sequence number to the store
  (``arrive/<rank>``; one small ``set``, a few µs on loopback). Every rank issues the same collectives on a
  group in the same order, so the numbers agree.
- The wait is ``work.wait(timeout)``. When it fails (a peer's connection closed, or the timeout passed), the rank
  posts ``<seq>/alive/<rank>`` and waits until every rank has either posted too or counts as missing: a rank that
  never arrived at this collective, once ``timeout`` has passed since it was issued or a grace of
  ``min(timeout, max(1 s, timeout / 10))`` has passed since the failure (a peer that is merely late gets that long),
  or any rank that has not posted within ``timeout`` of the failure (it arrived and then died).
- The first rank to decide writes the missing set with ``compare_set``; every rank raises with that one set, so
  the survivors agree (a late rank that finds itself in the set raises too: it was excluded).

The timeout applies to each collective wait (header exchange, payload, barrier). Default
:data:`DEFAULT_TIMEOUT_S` seconds, overridden by the ``DEEP_EP_NPU_TIMEOUT`` environment variable
(:mod:`deep_ep_npu.envs`), overridden per Buffer by ``Buffer(..., timeout=...)``.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from . import envs

DEFAULT_TIMEOUT_S = 30.0
"""Default bound on each collective wait (DeepEP's kernels use ~100 s; a decode step is milliseconds)."""

_POLL_S = 0.01


class EPRankFailure(RuntimeError):
    """A peer rank exited or stopped calling: raised on every surviving rank of the group.

    Attributes:
        missing_ranks: the ranks (in the group's numbering) that did not take part, sorted; empty when every rank
            answered and the collective failed for another reason (see the chained exception).
        op: what was running (e.g. ``"low_latency_dispatch"``).
        timeout: the wait bound in seconds.
        excluded: True on a rank that the other ranks already declared missing (it arrived too late).
    """

    def __init__(self, missing_ranks: Sequence[int], op: str, timeout: float, excluded: bool = False) -> None:
        self.missing_ranks = tuple(sorted(missing_ranks))
        self.op, self.timeout, self.excluded = op, timeout, excluded
        if excluded:
            what = f"this rank was declared failed by the other ranks (missing: {list(self.missing_ranks)})"
        elif self.missing_ranks:
            what = (
                f"ranks {list(self.missing_ranks)} did not take part within {timeout:g}s "
                "(they exited, crashed or stopped calling)"
            )
        else:
            what = "the collective failed although every rank is alive (see the cause)"
        super().__init__(f"{op}: {what}")


def resolve_timeout(timeout: float | None, param: str = "timeout") -> float:
    """``timeout`` if given, else ``DEEP_EP_NPU_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ValueError: ``timeout`` is not a positive finite number of seconds.
    """
    if timeout is None:
        env = envs.timeout_s()
        return DEFAULT_TIMEOUT_S if env is None else env
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{param}: must be a positive finite number of seconds or None, got {timeout!r}")
    return float(timeout)


class Pending:
    """An issued collective: its ``work`` (None when it completed synchronously) and its sequence number."""

    def __init__(self, monitor: GroupMonitor, seq: int, work: Any, started: float) -> None:
        self.monitor, self.seq, self.work, self.started = monitor, seq, work, started


class GroupMonitor:
    """Arrival marks, bounded waits and the missing-rank agreement of one process group (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        name = getattr(group, "group_name", "") or "default"
        self.store = dist.PrefixStore(f"deep_ep_npu/failure/{name}/", dist.distributed_c10d._get_default_store())
        self.seq = 0
        self.default_timeout = resolve_timeout(None)  # DEEP_EP_NPU_TIMEOUT, read once per group

    def start(self, launch: Callable[[], Any], op: str, timeout: float) -> Pending:
        """Mark arrival, then issue ``launch()`` (an ``async_op=True`` collective returning a work, or None)."""
        self.seq += 1
        started = time.monotonic()
        pending = Pending(self, self.seq, None, started)
        try:
            self.store.set(f"arrive/{self.rank}", str(self.seq))
            pending.work = launch()
        except RuntimeError as err:  # a peer already gone can fail the issue itself
            self._fail(pending, op, timeout, err)
        return pending

    def wait(self, pending: Pending, op: str, timeout: float) -> None:
        """Wait at most ``timeout`` seconds; on failure agree on the missing ranks and raise :class:`EPRankFailure`."""
        work, pending.work = pending.work, None
        if work is None:
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as err:
            self._fail(pending, op, timeout, err)

    def _fail(self, pending: Pending, op: str, timeout: float, cause: BaseException) -> None:
        try:
            missing = self.agree(pending.seq, pending.started, timeout)
        except (RuntimeError, ValueError) as store_err:  # the store itself is gone (its host rank died)
            raise EPRankFailure((), f"{op} (missing ranks unknown: store unreachable: {store_err})", timeout) from cause
        raise EPRankFailure(missing, op, timeout, excluded=self.rank in missing) from cause

    def _arrived(self, rank: int, seq: int) -> bool:
        key = f"arrive/{rank}"
        return self.store.check([key]) and int(self.store.get(key)) >= seq

    def agree(self, seq: int, started: float, timeout: float) -> tuple[int, ...]:
        """Post this rank as alive at collective ``seq`` and return the agreed missing ranks (sorted)."""
        prefix = f"{seq}/"
        self.store.set(f"{prefix}alive/{self.rank}", "1")
        failed_at = time.monotonic()
        grace = min(timeout, max(1.0, timeout / 10))
        while True:
            if self.store.check([f"{prefix}decision"]):
                return _parse(self.store.get(f"{prefix}decision"))
            now = time.monotonic()
            alive = [r for r in range(self.size) if self.store.check([f"{prefix}alive/{r}"])]
            undecided = [
                r
                for r in range(self.size)
                if r not in alive
                and not ((now - started >= timeout or now - failed_at >= grace) and not self._arrived(r, seq))
            ]
            if not undecided or now - failed_at >= timeout:
                missing = ",".join(str(r) for r in range(self.size) if r not in alive) or "-"
                return _parse(self.store.compare_set(f"{prefix}decision", "", missing))
            time.sleep(_POLL_S)


def _parse(value: bytes | str) -> tuple[int, ...]:
    text = value.decode() if isinstance(value, bytes) else value
    return () if text == "-" else tuple(int(v) for v in text.split(","))


_MONITORS: dict[str, tuple[dist.ProcessGroup, GroupMonitor]] = {}


def monitor(group: dist.ProcessGroup | None) -> GroupMonitor:
    """The :class:`GroupMonitor` of ``group`` (None: the default group); one per group per process."""
    pg = dist.group.WORLD if group is None else group
    assert pg is not None, "torch.distributed is not initialized"
    key = getattr(pg, "group_name", "") or "default"
    cached = _MONITORS.get(key)
    if cached is None or cached[0] is not pg:
        cached = (pg, GroupMonitor(pg))
        _MONITORS[key] = cached
    return cached[1]


def run(group: dist.ProcessGroup | None, launch: Callable[[], Any], op: str, timeout: float | None = None) -> None:
    """Issue ``launch()`` (an ``async_op=True`` collective on ``group``) and wait for it at most ``timeout`` seconds
    (None: the group's default, see :func:`resolve_timeout`)."""
    mon = monitor(group)
    seconds = mon.default_timeout if timeout is None else timeout
    mon.wait(mon.start(launch, op, seconds), op, seconds)
