"""Opt-in timing of where dispatch/combine time goes, and the bytes the last calls put on the wire. Off by default:
the engine then only reads :data:`enabled`. Benchmarks call :func:`enable`, run, and read :func:`report` (mean µs per
call of each section: the send phase with this rank's own rows, the wait, the placement / reduction) and
:func:`wire_stats`."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

enabled = False  # read by the engine before it records anything
_sections: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # name -> [total seconds, occurrences]


def enable() -> None:
    global enabled
    enabled = True


def disable() -> None:
    global enabled
    enabled = False


def add(prefix: str, **seconds: float) -> None:
    """Called by the engine while :data:`enabled`: one call's seconds in each of its sections."""
    for name, value in seconds.items():
        section = _sections[f"{prefix}.{name}"]
        section[0], section[1] = section[0] + value, section[1] + 1


def report(reset: bool = False) -> dict[str, float]:
    """Mean µs per occurrence of each section since the last reset."""
    out = {k: total / count * 1e6 for k, (total, count) in _sections.items()}
    if reset:
        _sections.clear()
    return out


def wire_stats(buffer: Any) -> dict:
    """Bytes of the last dispatch and combine of ``buffer`` (a ``Buffer`` or ``ElasticBuffer`` on the reference
    backend) on this rank: ``{op}_send_bytes`` (payload per destination, self included) and ``{op}_wire_bytes`` (what
    left this rank: payload to others + headers)."""
    engine, out = buffer._backend, {}
    for op, (per_rank, header) in engine.wire.items():
        out[f"{op}_send_bytes"] = per_rank
        out[f"{op}_wire_bytes"] = sum(per_rank) - per_rank[engine.rank] + header * (len(per_rank) - 1)
    return out
