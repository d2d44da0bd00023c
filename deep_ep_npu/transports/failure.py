"""Failure detection: every collective has a bounded wait, and a rank that exits or stops calling makes every other
rank raise :class:`EPRankFailure` naming the missing ranks within the timeout, never a hang.

The missing ranks are named through torch.distributed's own c10d store (:class:`GroupMonitor`, no extra transport):

- Before each collective on a group a rank sets ``arrive/<rank>`` to its collective sequence number on that group
  and the op it belongs to (ranks issue a group's collectives in the same order, so the numbers agree; a rank at the
  same number in another call, e.g. ``destroy()``'s barrier, has not arrived).
- When ``work.wait(timeout)`` fails (a peer's connection closed, or the timeout passed), the rank sets
  ``<seq>/<op>/alive/<rank>`` and waits until every rank has posted too or counts as missing: a rank that never
  arrived at ``seq``, once ``timeout`` has passed since the issue or a grace of ``min(timeout, max(1 s, timeout /
  10))`` since the failure (a late peer gets that long), or any rank not posted within ``timeout`` of the failure.
- The first rank to decide writes the missing set with ``compare_set``; every rank raises with that one set (a late
  rank that finds itself in it raises with ``excluded=True``). When the store is unreachable (its host exited, or is
  stopped: each store call of the agreement is bounded by the timeout) the set is unknown.

The timeout bounds each collective wait: :data:`DEFAULT_TIMEOUT_S`, overridden by ``DEEP_EP_NPU_TIMEOUT``
(:mod:`deep_ep_npu.envs`), overridden per Buffer by ``Buffer(..., timeout=...)``.
"""

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .. import envs

DEFAULT_TIMEOUT_S = 30.0
"""Default bound on each collective wait (DeepEP's kernels use ~100 s; a decode step is milliseconds)."""


class EPRankFailure(RuntimeError):
    """A peer rank exited or stopped calling: raised on every surviving rank of the group. Attributes:
    ``missing_ranks``, the ranks (in the group's numbering) that did not take part, sorted (empty when every rank
    answered and the collective failed for another reason: see the chained exception); ``op``, what was running (e.g.
    ``"low_latency_dispatch"``); ``timeout``, the wait bound in seconds; ``excluded``, True on a rank that the other
    ranks already declared missing (it arrived too late); ``unknown``, why the missing ranks could not be found
    (e.g. the store is unreachable: its host rank is gone), or ""."""

    def __init__(self, missing_ranks: Sequence[int], op: str, timeout: float, excluded: bool = False,
                 unknown: str = "") -> None:  # fmt: skip
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
        env = envs.timeout_s()
        return DEFAULT_TIMEOUT_S if env is None else env
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{param}: must be a positive finite number of seconds or None, got {timeout!r}")
    return float(timeout)


def _bounded(timeout: float, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` on the store, waiting at most ``timeout`` seconds: a TCPStore whose host is stopped never
    answers (its own timeout covers only key waits). The call runs in a daemon thread (left behind if it never
    returns; interpreter exit does not wait for it). Raises RuntimeError when it does not answer."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, call(*args)))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            out.append((False, err))

    thread = threading.Thread(target=run, name="deep_ep_npu-store", daemon=True)
    thread.start()
    thread.join(timeout)
    if not out:
        raise RuntimeError(f"the c10d store did not answer within {timeout:g}s (its host stopped?)")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def agree_missing(store: dist.Store, rank: int, size: int, key: str, started: float, timeout: float,
                  arrived: Callable[[int], bool]) -> tuple[int, ...]:  # fmt: skip
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
    text = call(store.get, decision).decode()
    return () if text == "-" else tuple(int(v) for v in text.split(","))
