"""The torch.distributed side: :class:`EPGroup`, the bounded communicator under every collective path (waits with a
timeout, the agreement step, deferred collectives issued in call order, shrink mode), and the collective transport.

The EP group's R ranks keep their numbers for a buffer's whole life (the mask stays `[R]`). Collectives run on the
*live* ranks: all R at first; after a failure in shrink mode, the survivors (agreed through :mod:`.failure`) build a
group of themselves, mark the failed ranks in the mask and re-run the interrupted call; R-long split lists and headers
drop the failed ranks' entries (0) on the way in and read zeros for them on the way out.

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

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from .agreement import STATUS_OK, Agreement, Check, Write
from .early import early_bytes
from .failure import EPRankFailure, agree_missing, resolve_timeout

_HEAD = 2  # header words before the counts in one round: status, spill
_R = TypeVar("_R")


class _Monitor:
    """The collective sequence number and arrival marks (:mod:`.failure`) of one process group, for every EPGroup."""

    def __init__(self, group: dist.ProcessGroup, name: str) -> None:
        self.group, self.rank, self.size, self.seq = group, dist.get_rank(group), dist.get_world_size(group), 0
        self.store = dist.PrefixStore(f"deep_ep_npu/failure/{name}/", dist.distributed_c10d._get_default_store())

    def arrived(self, rank: int, seq: int, op: str) -> bool:
        key = f"arrive/{rank}"
        if not self.store.check([key]):
            return False
        their_seq, their_op = self.store.get(key).decode().split(" ", 1)
        return int(their_seq) > seq or (int(their_seq) == seq and their_op == op)


_MONITORS: dict[str, _Monitor] = {}


@dataclasses.dataclass
class Pending:
    """An issued collective: its group's monitor, sequence number, op, issue time (monotonic), work (None: done)."""

    monitor: _Monitor
    seq: int
    op: str
    started: float
    work: Any = None


class EPGroup:
    """The R ranks of the EP ProcessGroup ``group``, of which ``live`` take part (see the module docstring). ``mask``:
    `[R]` `torch.int32`, the buffer's (shared; shrink mode sets failed ranks to 1); ``timeout``: seconds per collective
    wait, or None (``DEEP_EP_NPU_TIMEOUT``, else 30 s); ``enable_shrink``: continue on the survivors of a failure."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        mask: torch.Tensor | None = None,
        timeout: float | None = None,
        enable_shrink: bool = False,
    ) -> None:
        self.group, self.enable_shrink = group, enable_shrink
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32) if mask is None else mask
        self.timeout = resolve_timeout(timeout)
        self.live: list[int] = list(range(self.num_ranks))
        self.comm: dist.ProcessGroup = group  # the group of the live ranks; comm rank i is EP rank live[i]
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif "hccl" in backend:
            self.device = torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        else:
            self.device = torch.device("cpu")
        self._deferred: list[tuple[Callable[[], Any], list[Any]]] = []  # see defer()
        self._draining = False
        self.broken = False  # a call raised EPRankFailure (not recovered by shrinking): destroy() waits for no peer

    @property
    def failed(self) -> list[int]:
        """Ranks removed by shrink mode (they cannot be unmasked)."""
        return [r for r in range(self.num_ranks) if r not in self.live]

    def start(self, launch: Callable[[dist.ProcessGroup], Any], op: str) -> Pending:
        """Mark arrival at ``op`` (named alike on every rank), then issue ``launch(comm_group)`` (an ``async_op``
        collective returning its work)."""
        self._drain()  # collectives deferred by earlier calls go first (call order on every rank)
        name = getattr(self.comm, "group_name", "") or "default"
        mon = _MONITORS.get(name)
        if mon is None or mon.group is not self.comm:
            mon = _MONITORS[name] = _Monitor(self.comm, name)
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

    def transfer(
        self, recv: torch.Tensor, send: torch.Tensor, recv_rows: Sequence[int], send_rows: Sequence[int], op: str
    ) -> Pending | None:
        """Start moving `[rows, width]` uint8 ``send`` (``send_rows[r]`` rows for rank r, in rank order) into ``recv``
        (``recv_rows[r]`` rows from rank r); None on a group of one. Finish it with :meth:`wait`."""
        if self.num_ranks == 1:
            return None
        width = send.shape[1] if send.dim() == 2 else recv.shape[1]
        splits = [r * width for r in recv_rows], [r * width for r in send_rows]
        return self.all_to_all(recv.view(-1), send.reshape(-1), *splits, op)

    def defer(self, start: Callable[[], _R]) -> Callable[[], _R]:
        """Queue ``start`` (collectives a send phase leaves to its receive phase). The returned call runs the queue up
        to this one and returns its result (or raises its error); any other collective first runs the whole queue. So
        ranks issue collectives in call order, whatever order their receives (hooks) run in."""
        box: list[Any] = []
        self._deferred.append((start, box))

        def run() -> _R:
            self._drain(box)
            if isinstance(box[0], BaseException):
                raise box[0]
            return box[0]

        return run

    def _drain(self, until: list[Any] | None = None) -> None:
        """Run queued starts in order, until ``until`` holds a result (None: all); errors stay with their own."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._deferred and not until:
                first, first_box = self._deferred.pop(0)
                try:
                    first_box.append(first())
                except BaseException as err:  # noqa: BLE001 - kept for its own receive, re-raised there
                    first_box.append(err)
        finally:
            self._draining = False

    def barrier(self, op: str) -> None:
        """A bounded barrier of the live ranks (in shrink mode, of the survivors after a failure)."""
        self.retry(lambda: self.wait(self.start(lambda g: dist.barrier(group=g, async_op=True), op), op), lambda: None)

    def start_agree(
        self,
        op: str,
        status: int,
        counts: Sequence[Sequence[int]],
        shared: Sequence[int],
        device: torch.device | None = None,
    ) -> Callable[[], Agreement]:
        """Start the agreement step: every rank sends every peer one int64 row ``[status, *counts[peer], *shared]``
        (``counts``: C ints per rank), whose width does not depend on the input: a rank that rejected its input still
        completes it, and every rank raises instead of waiting. Returns ``finish() -> Agreement``. The tensor lives on
        ``device`` (default the group's) and is read back once."""
        live, width = self.live, len(counts[0]) if counts else 0
        rows = [[status, *counts[r], *shared] for r in live]
        send = torch.tensor(rows, dtype=torch.int64, device=device or self.device)
        recv, pending, t0 = send, None, time.perf_counter()
        if len(live) > 1:
            recv = torch.empty_like(send)
            pending = self.start(lambda g: dist.all_to_all_single(recv, send, group=g, async_op=True), op)

        def finish() -> Agreement:
            if pending is not None:
                self.wait(pending, op)
            got, wait_us = dict(zip(live, recv.tolist(), strict=True)), int((time.perf_counter() - t0) * 1e6)
            t = [got.get(r, [0] * (1 + width + len(shared))) for r in range(self.num_ranks)]
            return Agreement(
                [x[0] for x in t], [x[1 : 1 + width] for x in t], [tuple(x[1 + width :]) for x in t], wait_us, op
            )

        return finish

    def shrink(self, failure: EPRankFailure) -> None:
        """Continue without ``failure.missing_ranks``, on a group of the survivors (an existing one of exactly those
        ranks, else one built by them alone). Raises ``failure`` when shrink mode is off, this rank was itself
        excluded, or no rank is missing."""
        if not self.enable_shrink or failure.excluded or not failure.missing_ranks:
            raise failure
        survivors = [r for r in self.live if r not in failure.missing_ranks]
        all_ranks = dist.get_process_group_ranks(self.group)
        ranks = [all_ranks[r] for r in survivors]
        same = [pg for pg in dist.distributed_c10d._world.pg_names if dist.get_process_group_ranks(pg) == ranks]
        if same:
            self.comm = same[0]
        else:
            timeout = datetime.timedelta(seconds=self.timeout)
            group = dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True)
            assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER, "only survivors shrink"
            self.comm = group
        self.live = survivors
        self.mask[list(failure.missing_ranks)] = 1
        self.broken = False

    def retry(self, step: Callable[[], _R], rewind: Callable[[], None]) -> _R:
        """``step()``; in shrink mode, a rank failure shrinks the group, calls ``rewind()`` and runs it again."""
        while True:
            try:
                return step()
            except EPRankFailure as err:
                self.shrink(err)
                rewind()


class Collective:
    """The collective transport (see the module docstring): one round on a gloo group, the other calls handed to
    ``staged`` (:class:`~.staged.Staged`, required then). ``reuse``: the send / receive buffers alternate between two
    reused sets (at most two calls in flight, a buffer's rule), else each call gets its own."""

    name = "collective"

    def __init__(
        self, ep: EPGroup, reuse: bool = True, local: frozenset[int] = frozenset(), staged: Collective | None = None
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

    def send(
        self,
        op: str,
        counts: list[list[int]],
        shared: list[int],
        write: Write,
        check: Check,
        *,
        agree_now: bool = False,
        before_payload: Callable[[], bool] | None = None,
        device: torch.device | None = None,
    ) -> Any:
        if before_payload is not None or not self.early_bytes or device is not None and device.type != "cpu":
            assert self.staged is not None, "a TP stage, a group that is not gloo, device rows: the staged protocol"
            return self.staged.send(
                op, counts, shared, write, check, agree_now=agree_now, before_payload=before_payload, device=device
            )
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

    def _finish(
        self,
        op: str,
        pending: Pending | None,
        at: tuple[int, int],
        recv: torch.Tensor,
        posted: list[int],
        head: int,
        check: Check,
        rows: list[int],
        spilled: torch.Tensor,
    ) -> tuple[Agreement, list[Any], int]:
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
        agreement = Agreement(
            [w[0] for w in words],
            [w[_HEAD : _HEAD + num_counts] for w in words],
            [tuple(w[_HEAD + num_counts :]) for w in words],
            wait_us,
            op,
        )
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
