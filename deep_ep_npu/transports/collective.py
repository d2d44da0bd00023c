"""The collective transport (:class:`Collective`) on :class:`~.group.EPGroup`.

:class:`Collective` on a gloo group: one round per call, one all-to-all whose message to each rank is that rank's
header words followed by its rows; no agreement round goes first. Each receive is posted at a fixed bound per peer
(:func:`~.early.early_bytes`, the same on every rank and for every call: gloo aborts a process sent more bytes than
it posted, and a shorter message lands), and the header says how many rows arrived. The receiver checks the headers of
every live rank (status, fingerprint, the layout's vectors: the same words on every rank, so a rejected input or a
disagreement raises the same error everywhere) before any row is read. A rank whose rows for some peer would pass
the bound sends headers only and says so (``spill``); once the headers are checked, every rank takes part in a second
all-to-all of exact sizes carrying the spilled rows (issued in call order: :meth:`EPGroup.defer`). A call with a TP
stage (its rows change between the agreement and the payload), every call on another group and device tensors on a
gloo group take the two rounds of :class:`~.staged.Staged`: the agreement, then the payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .agreement import STATUS_OK, Agreement, Check, Write
from .early import early_bytes
from .group import EPGroup, Pending

_HEAD = 2  # header words before the counts in one round: status, spill


class Collective:
    """The collective transport (see the module docstring): one round on a gloo group, the other calls handed to
    ``staged`` (:class:`~.staged.Staged`, required then). ``reuse``: the send / receive buffers alternate between two
    reused sets (at most two calls in flight, a buffer's rule), else each call gets its own."""

    name = "collective"

    def __init__(self, ep: EPGroup, reuse: bool = True, local: frozenset[int] = frozenset(),
                 staged: Collective | None = None) -> None:  # fmt: skip
        self.ep, self.reuse, self._flip, self.staged = ep, reuse, 0, staged
        self.local = local  # ranks whose rows go another way (a spanning transport's window): none travel here
        self._buffers: dict[str, torch.Tensor] = {}
        self.early_bytes = early_bytes(ep.num_ranks, ep.device)  # (an early payload's rows per peer on gloo, else 0)

    def _buffer(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if not self.reuse or buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=device)
            if self.reuse:
                self._buffers[name] = buf
        return buf[:nbytes]

    def send(self, op: str, counts: list[list[int]], shared: list[int], write: Write, check: Check, *,
             agree_now: bool = False, before_payload: Callable[[], bool] | None = None,
             device: torch.device | None = None) -> Any:  # fmt: skip
        if before_payload is not None or not self.early_bytes or device is not None and device.type != "cpu":
            assert self.staged is not None, "a TP stage, a group that is not gloo, device rows: the staged protocol"
            return self.staged.send(op, counts, shared, write, check, agree_now=agree_now,
                                    before_payload=before_payload, device=device)  # fmt: skip
        ep, me, row_bytes = self.ep, self.ep.rank, shared[0]
        self._flip ^= 1
        tag, skip, head = self._flip, {me, *self.local}, 8 * (_HEAD + len(counts[0]) + len(shared))
        rows = [0 if d in skip else c[0] for d, c in enumerate(counts)]
        spill = any(head + n * row_bytes > self.early_bytes for n in rows)
        words = [[STATUS_OK, int(spill), *c, *shared] for c in counts]
        sizes = [head + (0 if spill else n * row_bytes) if d in ep.live else 0 for d, n in enumerate(rows)]
        send = self._message(f"send{tag}", words, sizes, head)
        spilled = self._buffer(f"spill{tag}", sum(rows) * row_bytes if spill else 0, send.device)
        begin = 0
        for d, n in enumerate(rows):
            if n and d in ep.live:
                at = begin if spill else sum(sizes[:d]) + head
                out = (spilled if spill else send)[at : at + n * row_bytes]
                write(d, out.view(n, row_bytes))
                begin += n * row_bytes if spill else 0
        posted = self._posted(head)
        recv = self._buffer(f"recv{tag}", sum(posted), send.device)
        started, pending = time.perf_counter_ns(), None
        if len(ep.live) > 1:
            pending = ep.all_to_all(recv, send, posted, sizes, op)
        else:  # (a group of one: its own header)
            recv.copy_(send[:head])

        def finish() -> tuple[Agreement, list[tuple[int, torch.Tensor]], int]:
            return self._finish(op, pending, (started, len(counts[0])), recv, posted, head, check, rows, spilled)

        if agree_now:
            done = finish()
            return lambda: done
        return ep.defer(finish)

    def receive(self, token: Any) -> tuple[Agreement, list[tuple[int, torch.Tensor]], int]:
        if callable(token):
            return token()
        assert self.staged is not None
        return self.staged.receive(token)  # (a tuple: the two rounds')

    def _message(self, name: str, words: list[list[int]], sizes: list[int], head: int) -> torch.Tensor:
        """The send buffer with each live rank's header words at the start of its message."""
        send, header = self._buffer(name, sum(sizes), torch.device("cpu")), torch.tensor(words, dtype=torch.int64)
        begin = 0
        for d, size in enumerate(sizes):
            if size:
                send[begin : begin + head].copy_(header[d].view(torch.uint8))
            begin += size
        return send

    def _posted(self, head: int) -> list[int]:
        """The bytes posted for each source: the bound from each live peer, this rank's own header."""
        ep = self.ep
        return [(head if s == ep.rank else self.early_bytes) if s in ep.live else 0 for s in range(ep.num_ranks)]

    def _finish(self, op: str, pending: Pending | None, at: tuple[int, int], recv: torch.Tensor, posted: list[int],
                head: int, check: Check, rows: list[int],
                spilled: torch.Tensor) -> tuple[Agreement, list[Any], int]:  # fmt: skip
        """Wait for the call's all-to-all, check every live rank's header, and return the agreement, the parts (after
        the spilled rows' second all-to-all, if any rank spilled) and the wait in ns (``at``: when the call started,
        in ns, and how many count words each header holds)."""
        (ep, me), (started, num_counts) = (self.ep, self.ep.rank), at
        t0 = time.perf_counter_ns()
        if pending is not None:
            ep.wait(pending, op)
        offsets = [sum(posted[:s]) for s in range(ep.num_ranks)]
        got = {s: recv[offsets[s] : offsets[s] + head].view(torch.int64).tolist() for s in ep.live}
        words = [got.get(s, [0] * (head // 8)) for s in range(ep.num_ranks)]
        wait_us = (time.perf_counter_ns() - started) // 1000
        agreement = Agreement([w[0] for w in words], [w[_HEAD : _HEAD + num_counts] for w in words],
                              [tuple(w[_HEAD + num_counts :]) for w in words], wait_us, op)  # fmt: skip
        check(agreement)
        row_bytes, masked = agreement.shared[me][0], ep.mask.tolist()
        sources = [s for s in ep.live if s != me and s not in self.local and not masked[s]]
        spills = {s for s in ep.live if words[s][1]}
        parts = [(s, recv[offsets[s] + head :][: agreement.counts[s][0] * row_bytes]) for s in sources]
        if spills and len(ep.live) > 1:  # (every rank saw the same flags: all take part)
            wanted = [agreement.counts[s][0] * row_bytes if s in spills else 0 for s in range(ep.num_ranks)]
            wanted = [n if s in sources else 0 for s, n in enumerate(wanted)]
            sent = [n * row_bytes if me in spills and d in ep.live else 0 for d, n in enumerate(rows)]
            late = torch.empty((sum(wanted),), dtype=torch.uint8)
            ep.wait(ep.all_to_all(late, spilled[: sum(sent)], wanted, sent, op), op)
            first = [sum(wanted[:s]) for s in range(ep.num_ranks)]
            parts = [(s, late[first[s] : first[s] + wanted[s]] if s in spills else part) for s, part in parts]
        return agreement, [(s, part.view(-1, row_bytes)) for s, part in parts], time.perf_counter_ns() - t0

    def reject(self, op: str, code: int, width: int, staged: bool = False) -> None:
        """Send every live rank a header with ``code`` and no rows (``staged``: the peers' call has a TP stage, whose
        agreement goes first: :meth:`~.staged.Staged.reject`)."""
        if staged or not self.early_bytes:
            assert self.staged is not None
            return self.staged.reject(op, code, width)
        ep, head = self.ep, 8 * (_HEAD + 2 + width)
        sizes = [head if d in ep.live else 0 for d in range(ep.num_ranks)]
        send = self._message("reject", [[code, 0, 0, -1, *[0] * width]] * ep.num_ranks, sizes, head)
        posted = self._posted(head)
        recv = torch.empty((sum(posted),), dtype=torch.uint8)
        ep.wait(ep.all_to_all(recv, send, posted, sizes, op), op)
        return None

    def done(self, token: Any) -> None:
        """Nothing to release: the buffers are the call's (or alternate)."""

    def close(self) -> None:
        self._buffers.clear()
