"""The collectives under the ops: a fixed-size header exchange, then one uneven ``all_to_all_single`` of bytes.

The header (one int64 row per peer) carries this rank's validation status, how many rows/pairs it sends to that
peer, and a fingerprint of the parameters every rank must agree on. It always has the same size, so it completes
even when a rank's input was rejected: every rank then raises instead of waiting forever on a peer that left.
The payload is a ``uint8`` buffer viewed as `[units, row_bytes]`; per destination it holds a metadata block
(padded to whole units) followed by the encoded rows, so the receive buffer can be indexed by row directly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..failure import monitor
from .errors import MoeDistributeError, shape

STATUS_OK = 0


@dataclasses.dataclass
class Header:
    """What each source rank announced: `status`, `rows`, `pairs` (towards this rank) and its fingerprint."""

    status: list[int]
    rows: list[int]
    pairs: list[int]
    fingerprint: list[tuple[int, ...]]
    wait_us: int = 0  # time spent in the header all-to-all (waiting for the slowest peer)


def exchange_header(
    group: dist.ProcessGroup | None,
    world_size: int,
    status: int,
    rows_per_dest: Sequence[int],
    pairs_per_dest: Sequence[int],
    fingerprint: Sequence[int],
    *,
    timeout: float | None = None,
    op: str = "header exchange",
) -> Header:
    """All-to-all of `[world_size, 3 + len(fingerprint)]` int64; returns what every peer sent to this rank.

    The wait is bounded by ``timeout`` seconds (None: ``DEEP_EP_NPU_TIMEOUT``, else 30 s); a peer that exited or
    did not call raises :class:`deep_ep_npu.failure.EPRankFailure` (naming it, labelled ``op``) on every rank."""
    send = header_tensor(status, rows_per_dest, pairs_per_dest, fingerprint)
    wait_us = 0
    if world_size == 1:
        recv = send
    else:
        recv = torch.empty_like(send)
        t0 = time.perf_counter()
        mon = monitor(group)
        seconds = mon.default_timeout if timeout is None else timeout
        mon.wait(
            mon.start(lambda: dist.all_to_all_single(recv, send, group=group, async_op=True), op, seconds), op, seconds
        )
        wait_us = int((time.perf_counter() - t0) * 1e6)
    return parse_header(recv, wait_us)


def header_tensor(
    status: int, rows_per_dest: Sequence[int], pairs_per_dest: Sequence[int], fingerprint: Sequence[int]
) -> torch.Tensor:
    """The header this rank sends: `[len(rows_per_dest), 3 + len(fingerprint)]` int64, one row per peer."""
    send = torch.empty((len(rows_per_dest), 3 + len(fingerprint)), dtype=torch.int64)
    send[:, 0] = status
    send[:, 1] = torch.tensor(list(rows_per_dest), dtype=torch.int64)
    send[:, 2] = torch.tensor(list(pairs_per_dest), dtype=torch.int64)
    send[:, 3:] = torch.tensor(list(fingerprint), dtype=torch.int64)
    return send


def parse_header(recv: torch.Tensor, wait_us: int = 0) -> Header:
    """The :class:`Header` from the received `[peers, 3 + F]` int64 rows."""
    rows = recv.tolist()
    header = Header([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [tuple(r[3:]) for r in rows])
    header.wait_us = wait_us
    return header


def check_header(header: Header, own_rank: int, fingerprint_names: Sequence[str], op: str) -> None:
    """Raise the same error on every rank if any rank rejected its input or the ranks disagree on a parameter."""
    bad = [(r, s) for r, s in enumerate(header.status) if s != STATUS_OK]
    if bad:
        ranks = ", ".join(f"rank {r} (aclnn {s})" for r, s in bad)
        raise MoeDistributeError(bad[0][1], "inputs", f"{op} aborted on every rank: rejected on {ranks}")
    for i, name in enumerate(fingerprint_names):
        values = [fp[i] for fp in header.fingerprint]
        if any(v != values[own_rank] for v in values):
            raise shape(name, f"{op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks")


def meta_units(num_pairs: int, meta_bytes: int, row_bytes: int) -> int:
    return (num_pairs * meta_bytes + row_bytes - 1) // row_bytes


def pack_payload(
    rows: torch.Tensor, rows_per_dest: Sequence[int], meta: torch.Tensor | None, pairs_per_dest: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """Interleave per destination: [meta block padded to whole rows][encoded rows]. Returns (buffer, units per dest).

    Arguments:
        rows: `[num_rows, row_bytes]` `torch.uint8`, sorted by destination.
        meta: `[num_pairs, meta_ints]` `torch.int32`, sorted by destination, or None.
    """
    row_bytes = rows.shape[1]
    parts, units, r0, p0 = [], [], 0, 0
    meta_bytes = 0 if meta is None else meta.shape[1] * 4
    for nr, npairs in zip(rows_per_dest, pairs_per_dest, strict=True):
        mu = meta_units(npairs, meta_bytes, row_bytes) if meta is not None else 0
        if mu:
            block = torch.zeros(mu * row_bytes, dtype=torch.uint8)
            block[: npairs * meta_bytes] = meta[p0 : p0 + npairs].reshape(-1).view(torch.uint8)
            parts.append(block.view(mu, row_bytes))
        parts.append(rows[r0 : r0 + nr])
        units.append(mu + nr)
        r0, p0 = r0 + nr, p0 + npairs
    buf = torch.cat(parts) if parts else rows.new_empty((0, row_bytes))
    return buf, units


class PendingExchange:
    """An in-flight uneven all-to-all of `[units, row_bytes]` uint8; :meth:`wait` returns the receive buffer (its
    wait bounded by ``timeout`` seconds, as :func:`exchange_header`)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        send: torch.Tensor,
        send_units: Sequence[int],
        recv_units: Sequence[int],
        *,
        timeout: float | None = None,
        op: str = "payload exchange",
    ) -> None:
        row_bytes = send.shape[1]
        self.recv = torch.empty((sum(recv_units), row_bytes), dtype=torch.uint8)
        self.started = time.perf_counter()
        self.wait_us = 0
        self.op = op
        if len(send_units) == 1:
            self.recv.copy_(send)
            self.work = None
        else:
            self._monitor = monitor(group)
            self._timeout = self._monitor.default_timeout if timeout is None else timeout
            self.work = self._monitor.start(
                lambda: dist.all_to_all_single(
                    self.recv.view(-1),
                    send.reshape(-1),
                    output_split_sizes=[u * row_bytes for u in recv_units],
                    input_split_sizes=[u * row_bytes for u in send_units],
                    group=group,
                    async_op=True,
                ),
                op,
                self._timeout,
            )
        self._send = send  # keep alive until the collective completes

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            pending, self.work = self.work, None
            self._monitor.wait(pending, self.op, self._timeout)
            self.wait_us = int((time.perf_counter() - t0) * 1e6)
        self._send = None
        return self.recv


def unpack_meta(
    recv: torch.Tensor, rows_per_src: Sequence[int], pairs_per_src: Sequence[int], meta_ints: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parse a buffer built by :func:`pack_payload`.

    Returns:
        meta: `[num_pairs, meta_ints]` `torch.int32`, concatenated in source-rank order.
        src: `[num_pairs]` `torch.int64`, the source rank of each pair.
        row_base: `[num_pairs]` `torch.int64`, the unit index in ``recv`` of the first row of that source's block
            (add the pair's row-in-block field to get its row).
    """
    row_bytes = recv.shape[1]
    metas, bases, unit = [], [], 0
    for nr, npairs in zip(rows_per_src, pairs_per_src, strict=True):
        mu = meta_units(npairs, meta_ints * 4, row_bytes)
        if npairs:
            metas.append(
                recv[unit : unit + mu].reshape(-1)[: npairs * meta_ints * 4].view(torch.int32).view(npairs, meta_ints)
            )
        bases.append(unit + mu)
        unit += mu + nr
    counts = torch.tensor(list(pairs_per_src), dtype=torch.int64)
    src = torch.repeat_interleave(torch.arange(len(counts)), counts)
    meta = torch.cat(metas) if metas else torch.empty((0, meta_ints), dtype=torch.int32)
    row_base = torch.tensor(bases, dtype=torch.int64)[src]
    return meta, src, row_base


def add_wait_time(performance_info: torch.Tensor | None, header: Header, wait_us: int) -> None:
    """Add this call's wait (µs: the header all-to-all plus the payload wait ``wait_us``) to ``performance_info[src]``
    for every source rank that sent this rank data. The reference path receives all sources in one collective, so
    they share its wait time. Accumulates; never resets."""
    if performance_info is None:
        return
    for src, (rows, pairs) in enumerate(zip(header.rows, header.pairs, strict=True)):
        if rows or pairs:
            performance_info[src] += header.wait_us + wait_us
