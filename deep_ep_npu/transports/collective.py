"""The torch.distributed side: :class:`Communicator`, the bounded collectives of an EP group's live ranks (each wait
with a timeout, a failure agreed through :mod:`.failure`, deferred collectives issued in call order), and the
collective transport on them. The group's membership (shrink mode) and its agreement step: :mod:`.group`.

:class:`Collective` on a gloo group: one round per call, one all-to-all whose message to each rank is that rank's
header words followed by its rows; no agreement round goes first. Each receive is posted at a fixed bound per peer
(:func:`~.early.early_bytes`, the same on every rank and for every call: gloo aborts a process sent more bytes than
it posted, and a shorter message lands), and the header says how many rows arrived. The receiver checks the headers of
every live rank (status, fingerprint, the layout's vectors: the same words on every rank, so a rejected input or a
disagreement raises the same error everywhere) before any row is read. A rank whose rows for some peer would pass
the bound sends headers only and says so (``spill``); once the headers are checked, every rank takes part in a second
all-to-all of exact sizes carrying the spilled rows (issued in call order: :meth:`Communicator.defer`). A call with a
TP stage (its rows change between the agreement and the payload), every call on another group and device tensors on
a gloo group take the two rounds of :class:`~.staged.Staged`: the agreement, then the payload.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from .agreement import STATUS_OK, Agreement, Received, Send
from .early import early_bytes
from .failure import MONITORS, EPRankFailure, Monitor, Pending, agree_missing, resolve_timeout

_HEAD = 2  # header words before the counts in one round: status, spill
_R = TypeVar("_R")


class Communicator:
    """The R ranks of the EP ProcessGroup ``group``, of which ``live`` take part: R-long split lists drop the other
    ranks' entries (0) on the way in. ``mask``: `[R]` `torch.int32`, the buffer's (shared); ``timeout``: seconds per
    collective wait, or None (``DEEP_EP_NPU_TIMEOUT``, else 30 s). Collectives run on ``comm``, the group of the live
    ranks (comm rank i is EP rank ``live[i]``)."""

    def __init__(self, group: dist.ProcessGroup, mask: torch.Tensor | None, timeout: float | None) -> None:
        self.group, self.num_ranks, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32) if mask is None else mask
        self.timeout = resolve_timeout(timeout)
        self.live: list[int] = list(range(self.num_ranks))
        self.comm: dist.ProcessGroup = group
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif "hccl" in backend:
            self.device = torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        else:
            self.device = torch.device("cpu")
        self._deferred: list[Callable[[], None]] = []  # see defer()
        self._draining = False
        self.broken = False  # a call raised EPRankFailure (not recovered by shrinking): destroy() waits for no peer

    def start(self, launch: Callable[[dist.ProcessGroup], dist.Work | None], op: str) -> Pending:
        """Mark arrival at ``op`` (named alike on every rank), then issue ``launch(comm_group)`` (an ``async_op``
        collective returning its work)."""
        self._drain()  # collectives deferred by earlier calls go first (call order on every rank)
        name = getattr(self.comm, "group_name", "") or "default"
        mon = MONITORS.get(name)
        if mon is None or mon.group is not self.comm:
            mon = MONITORS[name] = Monitor(self.comm, name)
        mon.seq += 1
        pending = Pending(mon, mon.seq, op, time.monotonic())
        try:
            mon.store.set(f"arrive/{mon.rank}", f"{mon.seq} {op}")
            pending.work = launch(self.comm)
        except RuntimeError as err:  # a peer already gone can fail the issue itself
            self._fail(pending, op, err)
        return pending

    def wait(self, pending: Pending, op: str) -> None:
        """Wait at most ``timeout`` seconds; on failure raise :class:`EPRankFailure` with the agreed missing ranks."""
        work, pending.work = pending.work, None
        if work is not None:
            try:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    work.wait()  # (a graph capture: a timed wait polls the work's event, which a capture forbids)
                else:
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as err:
                self._fail(pending, op, err)

    def _fail(self, pending: Pending, op: str, cause: BaseException) -> NoReturn:
        mon, seq = pending.monitor, pending.seq
        self.broken = True
        try:
            missing = agree_missing(
                mon.store,
                mon.rank,
                mon.size,
                f"{seq}/{pending.op}",
                pending.started,
                self.timeout,
                lambda r: mon.arrived(r, seq, pending.op),
            )
        except (RuntimeError, ValueError) as store_err:  # the store itself is gone (its host rank died)
            raise EPRankFailure((), op, self.timeout, unknown=f"store unreachable: {store_err}") from cause
        raise EPRankFailure([self.live[r] for r in missing], op, self.timeout, mon.rank in missing) from cause

    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int], send_splits: Sequence[int], op: str
    ) -> Pending:
        """Start an uneven all-to-all of flat tensors with R-long split lists (failed ranks' entries must be 0)."""
        outs, ins = [recv_splits[r] for r in self.live], [send_splits[r] for r in self.live]
        assert sum(outs) == sum(recv_splits) and sum(ins) == sum(send_splits), "failed ranks carry rows"
        return self.start(lambda g: dist.all_to_all_single(recv, send, outs, ins, group=g, async_op=True), op)

    def defer(self, start: Callable[[], _R]) -> Callable[[], _R]:
        """Queue ``start`` (collectives a send phase leaves to its receive phase). The returned call runs the queue up
        to this one and returns its result (or raises its error); any other collective first runs the whole queue. So
        ranks issue collectives in call order, whatever order their receives (hooks) run in."""
        result: list[_R] = []
        error: list[BaseException] = []

        def run_start() -> None:
            try:
                result.append(start())
            except BaseException as err:  # noqa: BLE001 - kept for its own receive, re-raised there
                error.append(err)

        self._deferred.append(run_start)

        def run() -> _R:
            self._drain(lambda: bool(result or error))
            if error:
                raise error[0]
            return result[0]

        return run

    def _drain(self, until: Callable[[], bool] = lambda: False) -> None:
        """Run queued starts in order, until ``until()`` (default: all); errors stay with their own."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._deferred and not until():
                self._deferred.pop(0)()
        finally:
            self._draining = False


@dataclasses.dataclass(frozen=True)
class CollectiveTicket:
    """A collective call in flight: ``result()`` runs its receive (after the collectives deferred before it)."""

    result: Callable[[], Received]

    def receive(self) -> Received:
        return self.result()

    def done(self) -> None:
        """Nothing to release: the buffers are the call's (or alternate)."""


class Collective:
    """The collective transport (see the module docstring): one round on a gloo group, the other calls handed to
    ``staged`` (:class:`~.staged.Staged`, required then). ``reuse``: the send / receive buffers alternate between two
    reused sets (at most two calls in flight, a buffer's rule), else each call gets its own."""

    name = "collective"

    def __init__(
        self,
        ep: Communicator,
        reuse: bool = True,
        local: frozenset[int] = frozenset(),
        staged: Collective | None = None,
    ) -> None:
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

    def send(self, request: Send) -> CollectiveTicket:
        device = request.device
        if request.before_payload is not None or not self.early_bytes or device is not None and device.type != "cpu":
            assert self.staged is not None, "a TP stage, a group that is not gloo, device rows: the staged protocol"
            return self.staged.send(request)
        ep, me, (counts, shared), row_bytes = self.ep, self.ep.rank, (request.counts, request.shared), request.shared[0]
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
                request.write(d, out.view(n, row_bytes))
                begin += n * row_bytes if spill else 0
        posted = self._posted(head)
        recv = self._buffer(f"recv{tag}", sum(posted), send.device)
        started, pending = time.perf_counter_ns(), None
        if len(ep.live) > 1:
            pending = ep.all_to_all(recv, send, posted, sizes, request.op)
        else:  # (a group of one: its own header)
            recv.copy_(send[:head])

        def finish() -> Received:
            return self._finish(request, pending, started, recv, posted, head, rows, spilled)

        if request.agree_now:
            done = finish()
            return CollectiveTicket(lambda: done)
        return CollectiveTicket(ep.defer(finish))

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

    def _finish(
        self,
        request: Send,
        pending: Pending | None,
        started: int,
        recv: torch.Tensor,
        posted: list[int],
        head: int,
        rows: list[int],
        spilled: torch.Tensor,
    ) -> Received:
        """Wait for the call's all-to-all, check every live rank's header, and return the agreement, the parts (after
        the spilled rows' second all-to-all, if any rank spilled) and the wait in ns (``started``: when the call
        started, in ns)."""
        ep, me, op, num_counts = self.ep, self.ep.rank, request.op, len(request.counts[0])
        t0 = time.perf_counter_ns()
        if pending is not None:
            ep.wait(pending, op)
        offsets = [sum(posted[:s]) for s in range(ep.num_ranks)]
        got = {s: recv[offsets[s] : offsets[s] + head].view(torch.int64).tolist() for s in ep.live}
        words = [got.get(s, [0] * (head // 8)) for s in range(ep.num_ranks)]
        wait_us = (time.perf_counter_ns() - started) // 1000
        agreement = Agreement(
            [w[0] for w in words],
            [w[_HEAD : _HEAD + num_counts] for w in words],
            [tuple(w[_HEAD + num_counts :]) for w in words],
            wait_us,
            op,
        )
        request.check(agreement)
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
        return Received(agreement, [(s, part.view(-1, row_bytes)) for s, part in parts], time.perf_counter_ns() - t0)

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

    def close(self) -> None:
        self._buffers.clear()
