"""Opt-in timing of where dispatch/combine time goes, and the bytes the last calls put on the wire.

Off by default: :func:`laps` then costs one flag check. Benchmarks call :func:`enable`, run, and read
:func:`report` (mean µs per call of each named section: validation, layout, packing, collectives, unpacking).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

_enabled = False
_totals: dict[str, float] = defaultdict(float)
_counts: dict[str, int] = defaultdict(int)
_wire: dict[str, tuple[list[int], int, int]] = {}


def enable() -> None:
    global _enabled
    _enabled = True


def disable() -> None:
    global _enabled
    _enabled = False


class _Laps:
    """Records the time since the previous lap (or creation) under ``prefix.name`` at each call."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.t = prefix, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        key = f"{self.prefix}.{name}"
        _totals[key] += now - self.t
        _counts[key] += 1
        self.t = now


class _NoLaps:
    def __call__(self, name: str) -> None:
        return None


_NO_LAPS = _NoLaps()


def laps(prefix: str) -> _Laps | _NoLaps:
    """``lap = laps("dispatch"); ...; lap("layout"); ...; lap("packing")`` - a no-op while disabled."""
    return _Laps(prefix) if _enabled else _NO_LAPS


def report(reset: bool = False) -> dict[str, float]:
    """Mean µs per occurrence of each section since the last reset."""
    out = {k: _totals[k] / _counts[k] * 1e6 for k in _totals}
    if reset:
        _totals.clear()
        _counts.clear()
    return out


def record_wire(op: str, send_bytes_per_rank: Sequence[int], own_rank: int, header_bytes: int) -> None:
    """Called by backends: payload bytes sent to each rank by the last ``op`` call, and header bytes per peer."""
    _wire[op] = (list(send_bytes_per_rank), own_rank, header_bytes)


def wire_stats(_buffer: object = None) -> dict:
    """Bytes of the last dispatch and combine on this rank: ``{op}_send_bytes`` (payload per destination, self
    included) and ``{op}_wire_bytes`` (what actually left this rank: payload to others + headers)."""
    out: dict[str, object] = {}
    for op, (per_rank, own, header) in _wire.items():
        out[f"{op}_send_bytes"] = per_rank
        out[f"{op}_wire_bytes"] = sum(per_rank) - per_rank[own] + header * (len(per_rank) - 1)
    return out
