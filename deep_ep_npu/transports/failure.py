"""Failure detection: every collective wait is bounded, and a rank that exits or stops calling makes every other rank
raise :class:`EPRankFailure` naming the missing ranks within the timeout, never a hang.

The missing ranks are agreed through the c10d store. Before each collective a rank sets ``arrive/<rank>`` to its
sequence number on the group and the op (ranks issue a group's collectives in the same order; a rank at the same
number in another call, e.g. ``destroy()``'s barrier, has not arrived). When a wait fails, the rank posts
``<key>/alive/<rank>`` and waits until every rank has posted or counts as missing: one that never arrived, once
``timeout`` has passed since the issue or a grace of ``min(timeout, max(1 s, timeout / 10))`` since the failure, or
any rank not posted within ``timeout`` of the failure. The first rank to decide writes the set (``compare_set``) and
every rank raises with it (a late rank that finds itself in it, with ``excluded=True``). When the store is unreachable
(each store call is bounded by the timeout) the set is unknown.

The timeout: ``Buffer(..., timeout=...)``, else ``DEEP_EP_NPU_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`.
"""

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch.distributed as dist

from .. import envs

_P = ParamSpec("_P")
_R = TypeVar("_R")
DEFAULT_TIMEOUT_S = 30.0
"""Default bound on each collective wait (DeepEP's kernels use ~100 s; a decode step is milliseconds)."""


class EPRankFailure(RuntimeError):
    """A peer rank exited or stopped calling: raised on every surviving rank of the group. Attributes:
    ``missing_ranks``, the ranks (in the group's numbering) that did not take part, sorted (empty when every rank
    answered and the collective failed for another reason: see the chained exception); ``op``, what was running (e.g.
    ``"low_latency_dispatch"``); ``timeout``, the wait bound in seconds; ``excluded``, True on a rank that the other
    ranks already declared missing (it arrived too late); ``unknown``, why the missing ranks could not be found
    (e.g. the store is unreachable: its host rank is gone), or ""."""

    def __init__(
        self, missing_ranks: Sequence[int], op: str, timeout: float, excluded: bool = False, unknown: str = ""
    ) -> None:
        self.missing_ranks = tuple(sorted(missing_ranks))
        self.op, self.timeout, self.excluded, self.unknown = op, timeout, excluded, unknown
        ranks = list(self.missing_ranks)
        if unknown:
            what = f"the collective failed and the missing ranks are unknown ({unknown})"
        elif excluded:
            what = f"this rank was declared failed by the other ranks (missing: {ranks})"
        elif ranks:
            what = f"ranks {ranks} did not take part within {timeout:g}s (they exited, crashed or stopped calling)"
        else:
            what = "the collective failed although every rank is alive (see the cause)"
        super().__init__(f"{op}: {what}")


def resolve_timeout(timeout: float | None, param: str = "timeout") -> float:
    """``timeout`` if given, else ``DEEP_EP_NPU_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`. Raises ValueError when
    ``timeout`` is not a positive finite number of seconds."""
    if timeout is None:
        return DEFAULT_TIMEOUT_S if (env := envs.timeout_s()) is None else env
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{param}: must be a positive finite number of seconds or None, got {timeout!r}")
    return float(timeout)


class Monitor:
    """The collective sequence number and arrival marks (see the module docstring) of one process group."""

    def __init__(self, group: dist.ProcessGroup, name: str) -> None:
        self.group, self.rank, self.size, self.seq = group, dist.get_rank(group), dist.get_world_size(group), 0
        self.store = dist.PrefixStore(f"deep_ep_npu/failure/{name}/", dist.distributed_c10d._get_default_store())

    def arrived(self, rank: int, seq: int, op: str) -> bool:
        key = f"arrive/{rank}"
        if not self.store.check([key]):
            return False
        their_seq, their_op = self.store.get(key).decode().split(" ", 1)
        return int(their_seq) > seq or (int(their_seq) == seq and their_op == op)


MONITORS: dict[str, Monitor] = {}


@dataclasses.dataclass
class Pending:
    """An issued collective: its group's monitor, sequence number, op, issue time (monotonic), work (None: done)."""

    monitor: Monitor
    seq: int
    op: str
    started: float
    work: dist.Work | None = None


def _bounded(timeout: float, call: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``call(*args, **kwargs)``, waiting at most ``timeout`` seconds (a TCPStore whose host is stopped never answers;
    its own timeout covers only key waits): it runs in a daemon thread, left behind if it never returns."""
    out: list[_R | BaseException] = []

    def run() -> None:
        try:
            out.append(call(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            out.append(err)

    thread = threading.Thread(target=run, name="deep_ep_npu-store", daemon=True)
    thread.start()
    thread.join(timeout)
    if not out:
        raise RuntimeError(f"the c10d store did not answer within {timeout:g}s (its host stopped?)")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def agree_missing(
    store: dist.Store, rank: int, size: int, key: str, started: float, timeout: float, arrived: Callable[[int], bool]
) -> tuple[int, ...]:
    """Post this rank (of ``size``) as alive at the failed collective ``key`` (issued at ``started``, monotonic) and
    return the agreed missing ranks, sorted (see the module docstring; ``arrived(r)``: whether rank r reached it)."""
    decision = f"{key}/decision"
    call = lambda fn, *args: _bounded(timeout, fn, *args)  # noqa: E731
    call(store.set, f"{key}/alive/{rank}", "1")
    failed_at, grace = time.monotonic(), min(timeout, max(1.0, timeout / 10))
    while not call(store.check, [decision]):
        now = time.monotonic()
        alive = [r for r in range(size) if call(store.check, [f"{key}/alive/{r}"])]
        late = now - started >= timeout or now - failed_at >= grace
        undecided = [r for r in range(size) if r not in alive and not (late and not call(arrived, r))]
        if not undecided or now - failed_at >= timeout:
            missing = ",".join(str(r) for r in range(size) if r not in alive) or "-"
            call(store.compare_set, decision, "", missing)
            break
        time.sleep(0.01)
    text = _bounded(timeout, store.get, decision).decode()
    return () if text == "-" else tuple(int(v) for v in text.split(","))
