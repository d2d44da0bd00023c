"""The torch.distributed side: :class:`EPGroup`, the bounded communicator under every collective path (waits with a
timeout, the agreement step, deferred collectives issued in call order, shrink mode), and the collective transport.

The EP group's R ranks keep their numbers for a buffer's whole life (the mask stays `[R]`). Collectives run on the
*live* ranks: all R at first; after a failure in shrink mode, the survivors (agreed through :mod:`.failure`) build a
group of themselves, mark the failed ranks in the mask and re-run the interrupted call; R-long split lists and headers
drop the failed ranks' entries (0) on the way in and read zeros for them on the way out.

:class:`Collective`: one all-to-all of the header words (the agreement), then one of the rows. The payload starts
once the agreement is checked: in the send phase with ``agree_now``, else in the receive phase (deferred, so that
every rank issues its payloads in call order); or at once when this rank knows what it receives (:mod:`.early`).
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
from .early import OVER_BOUND, PAYLOAD, check_started, early_bytes, started
from .failure import EPRankFailure, agree_missing, resolve_timeout

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

    def __init__(self, group: dist.ProcessGroup, mask: torch.Tensor | None = None, timeout: float | None = None,
                 enable_shrink: bool = False) -> None:  # fmt: skip
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
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as err:
                self._fail(pending, op, err)

    def _fail(self, pending: Pending, op: str, cause: BaseException) -> NoReturn:
        mon, seq = pending.monitor, pending.seq
        self.broken = True
        try:
            missing = agree_missing(mon.store, mon.rank, mon.size, f"{seq}/{pending.op}", pending.started,
                                    self.timeout, lambda r: mon.arrived(r, seq, pending.op))  # fmt: skip
        except (RuntimeError, ValueError) as store_err:  # the store itself is gone (its host rank died)
            raise EPRankFailure((), op, self.timeout, unknown=f"store unreachable: {store_err}") from cause
        raise EPRankFailure([self.live[r] for r in missing], op, self.timeout, mon.rank in missing) from cause

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int], send_splits: Sequence[int],
                   op: str) -> Pending:  # fmt: skip
        """Start an uneven all-to-all of flat tensors with R-long split lists (failed ranks' entries must be 0)."""
        outs, ins = [recv_splits[r] for r in self.live], [send_splits[r] for r in self.live]
        assert sum(outs) == sum(recv_splits) and sum(ins) == sum(send_splits), "failed ranks carry rows"
        return self.start(lambda g: dist.all_to_all_single(recv, send, outs, ins, group=g, async_op=True), op)

    def transfer(self, recv: torch.Tensor, send: torch.Tensor, recv_rows: Sequence[int], send_rows: Sequence[int],
                 op: str) -> Pending | None:  # fmt: skip
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

    def start_agree(self, op: str, status: int, counts: Sequence[Sequence[int]], shared: Sequence[int],
                    device: torch.device | None = None) -> Callable[[], Agreement]:  # fmt: skip
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
            return Agreement([x[0] for x in t], [x[1 : 1 + width] for x in t], [tuple(x[1 + width :]) for x in t],
                             wait_us, op)  # fmt: skip

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


def join_started(agreement: Agreement, ep: EPGroup, local: frozenset[int]) -> bool:
    """Join the payloads the peers started before the agreement, sending none on gloo (they posted the bound), else
    zeros of the posted size; whether any had started."""
    peers, bounded = started(agreement, ep.live, ep.rank), early_bytes(ep.num_ranks, ep.device) > 0
    if not peers:
        return False
    recv, send = [0] * ep.num_ranks, [0] * ep.num_ranks
    for s in (s for s in peers if s not in local):  # (this host's peers' rows go another way)
        width = agreement.shared[s][0] if agreement.shared[s] else 0
        recv[s], send[s] = agreement.counts[s][0] * width, 0 if bounded else agreement.counts[s][1] * width
    landing = torch.empty((sum(recv),), dtype=torch.uint8, device=ep.device)
    zeros = torch.zeros((sum(send),), dtype=torch.uint8, device=ep.device)
    ep.wait(ep.all_to_all(landing, zeros, recv, send, PAYLOAD), PAYLOAD)
    return True


class Collective:
    """The collective transport. ``reuse``: the send / receive buffers alternate between two reused sets (at most two
    calls in flight, a buffer's rule), else each call gets its own."""

    name = "collective"

    def __init__(self, ep: EPGroup, reuse: bool = True, local: frozenset[int] = frozenset()) -> None:
        self.ep, self.reuse, self._flip = ep, reuse, 0
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
        ep, me, row_bytes, dev = self.ep, self.ep.rank, shared[0], device or self.ep.device
        self._flip ^= 1
        tag, skip = self._flip, {me, *self.local}
        rows = [0 if d in skip else c[0] for d, c in enumerate(counts)]
        early = all(c[1] >= 0 for s, c in enumerate(counts) if s != me)  # every rank's rows known: start now
        bound = self.early_bytes if early else 0
        over = max(rows) * row_bytes > bound > 0  # (the engine keeps known rows within it: every rank raises)
        finish_agree = ep.start_agree(op, OVER_BOUND if over else STATUS_OK, counts, shared, device=dev)
        send = self._buffer(f"send{tag}", sum(rows) * row_bytes, dev).view(sum(rows), row_bytes)

        def write_all() -> None:
            begin = 0
            for d, k in enumerate(rows):
                if k:
                    write(d, send[begin : begin + k])
                begin += k

        def start_payload(posted: list[int]) -> tuple[list[int], torch.Tensor, Pending | None]:
            """The rows, ``posted[s]`` bytes received from rank s (this rank's rows sent whole, or none if over)."""
            if before_payload is not None and before_payload():
                write_all()  # (the rows changed: the TP stage)
            recv, sent = self._buffer(f"recv{tag}", sum(posted), dev), [0 if over else k * row_bytes for k in rows]
            src = send.view(-1)[: sum(sent)]
            return posted, recv, ep.all_to_all(recv, src, posted, sent, PAYLOAD) if ep.num_ranks > 1 else None

        def agree_and_start() -> tuple[Agreement, list[int], torch.Tensor, Pending | None]:
            agreement = finish_agree()
            if joined := any(c[1] >= 0 for s, c in enumerate(agreement.counts) if s in ep.live and s != me):
                join_started(agreement, ep, self.local)  # (peers that knew what they receive started already)
            check(agreement)
            if joined:
                check_started(agreement, ep.live, ep.rank, False)
            return agreement, *start_payload(
                [0 if s in skip else n * row_bytes for s, (n, *_) in enumerate(agreement.counts)]
            )

        write_all()
        if early:  # (at the bound, from every live peer, on gloo; else the known sizes)
            live = set(ep.live) - skip
            exact = [0 if s in skip else c[1] * row_bytes for s, c in enumerate(counts)]
            started = start_payload([bound * (s in live) for s in range(ep.num_ranks)] if bound else exact)
            return lambda: (None, *started), finish_agree, check
        if agree_now:
            started_now = agree_and_start()
            return lambda: started_now, None, None
        return ep.defer(agree_and_start), None, None

    def receive(self, token: Any) -> tuple[Agreement, list[tuple[int, torch.Tensor]], int]:
        start, finish_agree, check = token
        agreement, posted, recv, pending = start()  # (a deferred agreement and payload start now)
        t0 = time.perf_counter_ns()
        if pending is not None:
            self.ep.wait(pending, PAYLOAD)
        wait_ns = time.perf_counter_ns() - t0
        if agreement is None:  # the payload started early: the agreement is checked now
            agreement = finish_agree()
            check(agreement)
            if any(c[1] < 0 for s, c in enumerate(agreement.counts) if s in self.ep.live and s != self.ep.rank):
                check_started(agreement, self.ep.live, self.ep.rank, True)
        parts, begin, masked, row_bytes = [], 0, self.ep.mask.tolist(), agreement.shared[self.ep.rank][0]
        for s, nbytes in enumerate(posted):  # (each rank's announced rows: within what was posted for it)
            if s != self.ep.rank and s not in self.local and not masked[s]:
                n = agreement.counts[s][0]
                parts.append((s, recv[begin : begin + n * row_bytes].view(n, row_bytes)))
            begin += nbytes
        return agreement, parts, wait_ns

    def done(self, token: Any) -> None:
        """Nothing to release: the buffers are the call's (or alternate)."""

    def reject(self, op: str, code: int, width: int) -> None:
        join_started(self.ep.start_agree(op, code, [[0, -1]] * self.ep.num_ranks, [0] * width)(), self.ep, self.local)

    def close(self) -> None:
        self._buffers.clear()
