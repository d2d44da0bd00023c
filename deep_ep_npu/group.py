"""The communicator of every collective path: bounded collectives, the agreement step, and shrink mode.

The EP group's R ranks keep their numbers for the Buffer's whole life (``recv_x`` stays `[L, R * N, hidden]`, the
mask `[R]`). Collectives run on the *live* ranks: all R at first; after a failure in shrink mode (``enable_shrink``)
the survivors, who agreed on the failed set (:mod:`deep_ep_npu.failure`), build a group of themselves with
``torch.distributed.new_group(ranks=survivors, use_local_synchronization=True)`` (only survivors call it), mark the
failed ranks in the mask, and re-run the interrupted call there. R-long split lists and headers drop the failed ranks'
entries on the way in (they are 0: masked ranks send and receive nothing) and read a neutral value on the way out.
"""

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from .errors import MoeDistributeError, shape
from .event import Completion
from .failure import EPRankFailure, GroupMonitor, monitor, resolve_timeout
from .group_names import comm_device

_R = TypeVar("_R")
STATUS_OK = 0
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.int8: 4}  # dtypes in fingerprints


@dataclasses.dataclass
class Agreement:
    """What every source rank announced to this rank in one agreement step (lists indexed by source rank)."""

    status: list[int]
    counts: list[list[int]]
    shared: list[tuple[int, ...]]
    wait_us: int
    op: str

    def check(self, own_rank: int, names: Sequence[str], offset: int = 0) -> None:
        """Raise the same error on every rank if any rank rejected its input, or if the ranks disagree on one of
        the ``names`` (``shared[offset + i]`` is ``names[i]``)."""
        bad = [(r, s) for r, s in enumerate(self.status) if s != STATUS_OK]
        if bad:
            ranks = ", ".join(f"rank {r} (aclnn {s})" for r, s in bad)
            raise MoeDistributeError(bad[0][1], "inputs", f"{self.op} aborted on every rank: rejected on {ranks}")
        for i, name in enumerate(names):
            values = [fp[offset + i] for fp in self.shared]
            if any(v != values[own_rank] for v in values):
                msg = f"{self.op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks"
                raise shape(name, msg)


@dataclasses.dataclass
class Pending:
    """An issued collective: its group's monitor, sequence number, op, issue time (monotonic), work (None: done)."""

    monitor: GroupMonitor
    seq: int
    op: str
    started: float
    work: Any = None


class EPGroup:
    """R ranks of ``group``, of which ``live`` take part (see the module docstring).

    Arguments:
        group: the EP ProcessGroup.
        mask: `[R]` `torch.int32`, the Buffer's mask (shared; shrink mode sets failed ranks to 1).
        timeout: seconds per collective wait, or None (``DEEP_EP_NPU_TIMEOUT``, else 30 s).
        enable_shrink: on a rank failure, continue on the survivors instead of raising.
    """

    def __init__(self, group: dist.ProcessGroup, mask: torch.Tensor, timeout: float | None = None,
                 enable_shrink: bool = False) -> None:  # fmt: skip
        self.group, self.mask, self.enable_shrink = group, mask, enable_shrink
        self.num_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.timeout = resolve_timeout(timeout)
        self.live: list[int] = list(range(self.num_ranks))
        self.comm: dist.ProcessGroup = group  # the group of the live ranks; comm rank i is EP rank live[i]
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
        mon = monitor(self.comm)
        mon.seq += 1
        pending = Pending(mon, mon.seq, op, time.monotonic())
        try:
            mon.arrive(pending.seq, op)
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
        mon = pending.monitor
        try:
            missing = mon.agree(pending.seq, pending.op, pending.started, self.timeout)
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
                 op: str) -> Completion:  # fmt: skip
        """Start moving `[rows, width]` uint8 ``send`` (``send_rows[r]`` rows for rank r, in rank order) into ``recv``
        (``recv_rows[r]`` rows from rank r); ``wait()`` waits (bounded) and returns the nanoseconds it waited."""
        pending = None
        if self.num_ranks > 1:
            width = send.shape[1] if send.dim() == 2 else recv.shape[1]
            splits = [r * width for r in recv_rows], [r * width for r in send_rows]
            pending = self.all_to_all(recv.view(-1), send.reshape(-1), *splits, op)

        def finish(keep: tuple[torch.Tensor, ...] = (recv, send)) -> int:  # keep: the tensors live until the wait
            if pending is None:
                return 0
            t0 = time.perf_counter_ns()
            self.wait(pending, op)
            return time.perf_counter_ns() - t0

        return Completion(finish)

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
                    neutral: Sequence[int] | None = None,
                    device: torch.device | str | None = None) -> Callable[[], Agreement]:  # fmt: skip
        """Start the agreement step: every rank sends every peer one int64 row ``[status, *counts[peer], *shared]``
        (``counts``: C ints per rank, e.g. the rows it will send there; ``shared``: the same for every peer, e.g. the
        fingerprint all ranks must agree on). The row's width does not depend on the input, so a rank that rejected
        its input still completes the step and every rank raises instead of waiting. Returns ``finish() ->
        Agreement``; ranks removed by shrink mode read as status 0, zero counts and ``neutral`` (default ``shared``).
        The tensor lives on ``device`` (default the group's) and is read back once."""
        live, width = self.live, len(counts[0]) if counts else 0
        rows = [[status, *counts[r], *shared] for r in live]
        send = torch.tensor(rows, dtype=torch.int64, device=device or comm_device(self.comm))
        recv, pending, t0 = send, None, time.perf_counter()
        if len(live) > 1:
            recv = torch.empty_like(send)
            pending = self.start(lambda g: dist.all_to_all_single(recv, send, group=g, async_op=True), op)

        def finish() -> Agreement:
            if pending is not None:
                self.wait(pending, op)
            got, wait_us = dict(zip(live, recv.tolist(), strict=True)), int((time.perf_counter() - t0) * 1e6)
            fill = [0, *([0] * width), *(shared if neutral is None else neutral)]
            t = [got.get(r, fill) for r in range(self.num_ranks)]
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

    def run(self, send: Callable[[], _R], rewind: Callable[[], None]) -> _R:
        """Run a backend call: ``send()`` runs its send phase and returns a result whose ``completion`` is the
        receive phase. In shrink mode a rank failure in either phase shrinks the group, calls ``rewind()`` (the
        backend's buffer indices go back, so the re-run writes the same result tensors) and re-runs ``send()``."""
        if not self.enable_shrink:
            return send()

        def retry(step: Callable[[], Any]) -> Any:
            while True:
                try:
                    return step()
                except EPRankFailure as err:
                    self.shrink(err)
                    rewind()

        result: Any = retry(send)
        first = [result.completion]

        def finish() -> None:  # the first attempt waits for the first send's receive; each later one re-sends
            retry(lambda: (first.pop() if first else retry(send).completion).wait())

        return result._replace(completion=Completion(finish))


def _survivor_group(global_ranks: list[int], timeout: float) -> dist.ProcessGroup:
    """A group of ``global_ranks`` built by them alone (an existing group of exactly those ranks is reused)."""
    for pg in dist.distributed_c10d._world.pg_names:
        if dist.get_process_group_ranks(pg) == global_ranks:
            return pg
    timeout_td = datetime.timedelta(seconds=timeout)
    group = dist.new_group(ranks=global_ranks, timeout=timeout_td, use_local_synchronization=True)
    assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER, "only survivors shrink"
    return group


_GROUPS: dict[int, EPGroup] = {}


def ep_group(group: dist.ProcessGroup) -> EPGroup:
    """The :class:`EPGroup` the ops use for ``group`` when no Buffer owns one (timeout: ``DEEP_EP_NPU_TIMEOUT``,
    else the default; no shrink); one per group per process."""
    if id(group) not in _GROUPS or _GROUPS[id(group)].group is not group:
        _GROUPS[id(group)] = EPGroup(group, torch.zeros((dist.get_world_size(group),), dtype=torch.int32))
    return _GROUPS[id(group)]
