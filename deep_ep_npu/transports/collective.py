"""The torch.distributed side of the engine: the bounded communicator :class:`EPGroup` under every collective path
(collectives with a timeout, the agreement step, payloads issued in call order, shrink mode) and the collective
transport :class:`Collective` on it.

The EP group's R ranks keep their numbers for a buffer's whole life (``recv_x`` stays `[L, R * N, hidden]`, the mask
`[R]`). Collectives run on the *live* ranks: all R at first; after a failure in shrink mode (``enable_shrink``) the
survivors, who agreed on the failed set (:mod:`.failure`), build a group of themselves with
``torch.distributed.new_group(ranks=survivors, use_local_synchronization=True)`` (only survivors call it), mark the
failed ranks in the mask, and re-run the interrupted call there. R-long split lists and headers drop the failed ranks'
entries on the way in (they are 0: masked ranks send and receive nothing) and read zeros on the way out. Before each
collective a rank marks its arrival in the c10d store (``arrive/<rank>``: its collective sequence number on the group
and the op), so that a failed wait can name the ranks that never came (:func:`.failure.agree_missing`).

The collective transport: rows move by one uneven all-to-all after one agreement all-to-all of the header words.
The send phase starts the agreement step and writes the rows while it travels. The payload's sizes come with the
agreement, so the payload starts once the agreement is back and checked: in the send phase with ``agree_now`` (a
peer's rejection then raises there), else in the receive phase, queued so that every rank issues its payloads in
call order (:meth:`EPGroup.defer`). When every rank already knows what it receives (a cached layout:
``counts[d][1] >= 0``) the payload starts at once and the agreement is checked in the receive phase; a rank that does
not know (a fresh call, or one that rejected its input) takes part in its peers' started payloads with zeros, so that
every rank gets to raise instead of waiting.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from .failure import EPRankFailure, agree_missing, resolve_timeout

_R = TypeVar("_R")
STATUS_OK = 0


@dataclasses.dataclass
class Agreement:
    """What every source rank announced to this rank in one agreement step (lists indexed by source rank): its status
    (0, or the aclnn code of its rejected input), its per-destination words for this rank, its shared words, and how
    long the step waited (µs)."""

    status: list[int]
    counts: list[list[int]]
    shared: list[tuple[int, ...]]
    wait_us: int
    op: str


class _Monitor:
    """The collective sequence number and arrival marks of one process group (shared by every EPGroup on it)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.rank, self.size, self.seq = group, dist.get_rank(group), dist.get_world_size(group), 0
        name = getattr(group, "group_name", "") or "default"
        self.store = dist.PrefixStore(f"deep_ep_npu/failure/{name}/", dist.distributed_c10d._get_default_store())

    def arrived(self, rank: int, seq: int, op: str) -> bool:
        """Whether ``rank`` reached collective ``seq`` of ``op`` (a rank at the same number in another call, e.g. a
        barrier of ``destroy()`` while its peers dispatch, has not)."""
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
    """R ranks of ``group``, of which ``live`` take part (see the module docstring).

    Arguments:
        group: the EP ProcessGroup.
        mask: `[R]` `torch.int32`, the buffer's mask (shared; shrink mode sets failed ranks to 1).
        timeout: seconds per collective wait, or None (``DEEP_EP_NPU_TIMEOUT``, else 30 s).
        enable_shrink: on a rank failure, continue on the survivors instead of raising.
    """

    def __init__(self, group: dist.ProcessGroup, mask: torch.Tensor | None = None, timeout: float | None = None,
                 enable_shrink: bool = False) -> None:  # fmt: skip
        self.group, self.enable_shrink = group, enable_shrink
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32) if mask is None else mask
        self.timeout = resolve_timeout(timeout)
        self.live: list[int] = list(range(self.num_ranks))
        self.comm: dist.ProcessGroup = group  # the group of the live ranks; comm rank i is EP rank live[i]
        self.device = comm_device(group)
        self._deferred: list[tuple[Callable[[], Any], list[Any]]] = []  # see defer()
        self._draining = False

    @property
    def failed(self) -> list[int]:
        """Ranks removed from the group by shrink mode (they cannot be unmasked)."""
        return [r for r in range(self.num_ranks) if r not in self.live]

    def start(self, launch: Callable[[dist.ProcessGroup], Any], op: str) -> Pending:
        """Mark arrival at ``op``, then issue ``launch(comm_group)`` (an ``async_op=True`` collective returning its
        work). Every rank of one call names its collectives alike (the op, "payload exchange", ...)."""
        self._drain()  # collectives deferred by earlier calls go first (call order on every rank)
        key = getattr(self.comm, "group_name", "") or "default"
        mon = _MONITORS.get(key)
        if mon is None or mon.group is not self.comm:
            mon = _MONITORS[key] = _Monitor(self.comm)
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
        try:
            arrived = lambda r: mon.arrived(r, seq, pending.op)  # noqa: E731
            missing = agree_missing(mon.store, mon.rank, mon.size, f"{seq}/{pending.op}", pending.started,
                                    self.timeout, arrived)  # fmt: skip
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
        """Queue ``start`` (the collectives a send phase left to its receive phase, e.g. a payload whose size comes
        with the agreement); the returned call runs every queued start up to and including this one, in the order
        they were queued, and returns this one's result (or raises its error). Any other collective first runs the
        whole queue (:meth:`start`). Ranks thus issue their collectives in call order, whatever order their
        receives (hooks) run in and whatever they call in between."""
        box: list[Any] = []
        self._deferred.append((start, box))

        def run() -> _R:
            self._drain(box)
            ok, value = box[0]
            if not ok:
                raise value
            return value

        return run

    def _drain(self, until: list[Any] | None = None) -> None:
        """Run queued starts in order, until ``until`` holds a result (None: all); errors stay with their own."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._deferred and (until is None or not until):
                first, first_box = self._deferred.pop(0)
                try:
                    first_box.append((True, first()))
                except BaseException as err:  # noqa: BLE001 - kept for its own receive, re-raised there
                    first_box.append((False, err))
        finally:
            self._draining = False

    def barrier(self, op: str) -> None:
        """A bounded barrier of the live ranks (in shrink mode, of the survivors after a failure)."""
        while True:
            try:
                return self.wait(self.start(lambda g: dist.barrier(group=g, async_op=True), op), op)
            except EPRankFailure as err:
                self.shrink(err)

    def start_agree(self, op: str, status: int, counts: Sequence[Sequence[int]], shared: Sequence[int],
                    device: torch.device | None = None) -> Callable[[], Agreement]:  # fmt: skip
        """Start the agreement step: every rank sends every peer one int64 row ``[status, *counts[peer], *shared]``
        (``counts``: C ints per rank, e.g. the rows it will send there; ``shared``: the same for every peer). The
        row's width does not depend on the input, so a rank that rejected its input still completes the step and
        every rank raises instead of waiting. Returns ``finish() -> Agreement``; ranks removed by shrink mode read as
        status 0 and zeros. The tensor lives on ``device`` (default the group's) and is read back once."""
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

    def reject(self, op: str, code: int, num_counts: int, num_shared: int) -> None:
        """This rank rejected its input of ``op``: take part in its agreement step with status ``code``."""
        self.start_agree(op, code, [[0] * num_counts for _ in range(self.num_ranks)], [0] * num_shared)()

    def shrink(self, failure: EPRankFailure) -> None:
        """Drop ``failure.missing_ranks`` from the live set and continue on a new group of the survivors. Raises
        ``failure`` when shrink mode is off, this rank was itself excluded, or no rank is missing."""
        if not self.enable_shrink or failure.excluded or not failure.missing_ranks:
            raise failure
        survivors = [r for r in self.live if r not in failure.missing_ranks]
        all_ranks = dist.get_process_group_ranks(self.group)
        self.comm = _survivor_group([all_ranks[r] for r in survivors], self.timeout)
        self.live = survivors
        self.mask[list(failure.missing_ranks)] = 1

    def retry(self, step: Callable[[], _R], rewind: Callable[[], None]) -> _R:
        """``step()``; in shrink mode, a rank failure shrinks the group, calls ``rewind()`` and runs it again."""
        while True:
            try:
                return step()
            except EPRankFailure as err:
                self.shrink(err)
                rewind()


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """The device of ``group``'s collectives: NCCL the current CUDA device, HCCL the current NPU, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def _survivor_group(global_ranks: list[int], timeout: float) -> dist.ProcessGroup:
    """A group of ``global_ranks`` built by them alone (an existing group of exactly those ranks is reused)."""
    for pg in dist.distributed_c10d._world.pg_names:
        if dist.get_process_group_ranks(pg) == global_ranks:
            return pg
    timeout_td = datetime.timedelta(seconds=timeout)
    group = dist.new_group(ranks=global_ranks, timeout=timeout_td, use_local_synchronization=True)
    assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER, "only survivors shrink"
    return group


PAYLOAD = "payload exchange"


class Collective:
    """The collective transport (see the module docstring). ``reuse``: the send / receive buffers alternate between two
    reused sets (at most two calls in flight, a buffer's rule), else each call gets its own."""

    name = "collective"

    def __init__(self, ep: EPGroup, reuse: bool = True) -> None:
        self.ep, self.reuse, self._flip = ep, reuse, 0
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, rows: int, row_bytes: int, device: torch.device) -> torch.Tensor:
        """`[rows, row_bytes]` uint8: a reused buffer (grown when a call needs more), or a fresh one."""
        buf, nbytes = self._buffers.get(name), rows * row_bytes
        if not self.reuse or buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=device)
            if self.reuse:
                self._buffers[name] = buf
        return buf[:nbytes].view(rows, row_bytes)

    def send(self, op: str, counts: list[list[int]], shared: list[int], write: Callable[[int, torch.Tensor], None],
             check: Callable[[Agreement], None], *, agree_now: bool = False,
             before_payload: Callable[[], bool] | None = None, device: torch.device | None = None) -> Any:  # fmt: skip
        ep, me, row_bytes, dev = self.ep, self.ep.rank, shared[0], device or self.ep.device
        self._flip ^= 1
        tag = self._flip
        finish_agree = ep.start_agree(op, STATUS_OK, counts, shared, device=dev)
        rows = [0 if d == me else c[0] for d, c in enumerate(counts)]
        send = self._buffer(f"send{tag}", sum(rows), row_bytes, dev)

        def write_all() -> None:
            begin = 0
            for d, k in enumerate(rows):
                if k:
                    write(d, send[begin : begin + k])
                begin += k

        write_all()

        def start_payload(recv_rows: list[int]) -> tuple[torch.Tensor, Any]:
            if before_payload is not None and before_payload():
                write_all()  # (the rows changed: the TP stage)
            recv = self._buffer(f"recv{tag}", sum(recv_rows), row_bytes, dev)
            return recv, ep.transfer(recv, send, recv_rows, rows, PAYLOAD)

        def agree_and_start() -> tuple[Agreement, list[int], tuple[torch.Tensor, Any]]:
            agreement = finish_agree()
            _join_started_peers(ep, agreement)
            check(agreement)
            recv_rows = [0 if s == me else c[0] for s, c in enumerate(agreement.counts)]
            return agreement, recv_rows, start_payload(recv_rows)

        if all(c[1] >= 0 for s, c in enumerate(counts) if s != me):  # every rank's rows known: start now
            known = [0 if s == me else c[1] for s, c in enumerate(counts)]
            return finish_agree, None, known, start_payload(known), check
        if agree_now:
            return None, *agree_and_start(), None
        return None, ep.defer(agree_and_start), None, None, None

    def receive(self, token: Any) -> tuple[Agreement, list[tuple[int, torch.Tensor]], int]:
        finish_agree, agreement, recv_rows, started, check = token
        if callable(agreement):  # deferred: the agreement (checked) and the payload come now
            agreement, recv_rows, started = agreement()
        recv, pending = started
        wait_ns = self._wait(pending)
        if finish_agree is not None:  # the payload started with known counts: the agreement is checked now
            agreement = finish_agree()
            check(agreement)
        parts, begin, masked = [], 0, self.ep.mask.tolist()
        for s, k in enumerate(recv_rows):
            if s != self.ep.rank and not masked[s]:
                parts.append((s, recv[begin : begin + k]))
            begin += k
        return agreement, parts, wait_ns

    def _wait(self, pending: Any) -> int:
        t0 = time.perf_counter_ns()
        if pending is not None:
            self.ep.wait(pending, PAYLOAD)
        return time.perf_counter_ns() - t0

    def done(self, token: Any) -> None:
        """Nothing to release: the buffers are the call's (or alternate)."""

    def reject(self, op: str, code: int, width: int) -> None:
        counts = [[0, -1] for _ in range(self.ep.num_ranks)]
        agreement = self.ep.start_agree(op, code, counts, [0] * width)()
        _join_started_peers(self.ep, agreement)

    def close(self) -> None:
        self._buffers.clear()


def _join_started_peers(ep: EPGroup, agreement: Agreement) -> None:
    """Peers that knew their counts started their payload before the agreement: a rank that did not takes part in it
    with zeros (the rows each announced), so that every rank gets to the agreement's check and raises."""
    me = ep.rank
    peers = [s for s, c in enumerate(agreement.counts) if s != me and c and c[1] >= 0]
    if not peers:
        return
    width = [fp[0] if fp else 0 for fp in agreement.shared]
    recv = [agreement.counts[s][0] * width[s] if s in peers else 0 for s in range(ep.num_ranks)]
    send = [agreement.counts[s][1] * width[s] if s in peers else 0 for s in range(ep.num_ranks)]
    dev = ep.device
    recv_t = torch.empty((sum(recv),), dtype=torch.uint8, device=dev)
    zeros = torch.zeros((sum(send),), dtype=torch.uint8, device=dev)
    ep.wait(ep.all_to_all(recv_t, zeros, recv, send, PAYLOAD), PAYLOAD)
