"""The bounded communicator under every collective path (:class:`EPGroup`): waits with a timeout, the agreement step,
deferred collectives issued in call order, shrink mode.

The EP group's R ranks keep their numbers for a buffer's whole life (the mask stays `[R]`). Collectives run on the
*live* ranks: all R at first; after a failure in shrink mode, the survivors (agreed through :mod:`.failure`) build a
group of themselves, mark the failed ranks in the mask and re-run the interrupted call; R-long split lists and headers
drop the failed ranks' entries (0) on the way in and read zeros for them on the way out."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from .agreement import Agreement
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
