"""The communicator of every collective path: bounded collectives, the agreement step, and shrink mode.

The EP group's R ranks keep their numbers for the Buffer's whole life (``recv_x`` stays `[L, R * N, hidden]`,
the mask stays `[R]`). Collectives run on the *live* ranks: all R at first; after a failure in shrink mode
(``enable_shrink=True``) the survivors, who agreed on the failed set (:mod:`deep_ep_npu.failure`), build a new
group of themselves with ``torch.distributed.new_group(ranks=survivors, use_local_synchronization=True)``
(torch.distributed's own rendezvous, only survivors call it), mark the failed ranks in the mask, and re-run the
interrupted call there. Per-rank split lists and headers stay R long; the failed ranks' entries are dropped on the
way in (they are 0: masked ranks send and receive nothing) and filled with a neutral value on the way out.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import MoeDistributeError, invalid, null, shape
from .event import Completion
from .failure import EPRankFailure, GroupMonitor, Pending, monitor, resolve_timeout

_R = TypeVar("_R")
STATUS_OK = 0


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
                raise shape(
                    name, f"{self.op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks"
                )


def resolve_group(group: object, param: str) -> dist.ProcessGroup:
    """The process group ``group`` is or names (``ProcessGroup.group_name``).

    Raises:
        MoeDistributeError: ``group`` is None or empty (161001), or names no group of this process (161002).
    """
    if group is None or group == "":
        raise null(param, "pass the ProcessGroup or its group name")
    if isinstance(group, dist.ProcessGroup):
        return group
    if not isinstance(group, str):
        raise invalid(param, f"must be a ProcessGroup or its name (str), got {type(group).__name__}")
    if not dist.is_initialized():
        raise invalid(param, f"no process group named {group!r}: torch.distributed is not initialized")
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        if name == group:
            return pg
    known = sorted(dist.distributed_c10d._world.pg_names.values())
    raise invalid(param, f"no process group named {group!r} in this process; known names: {known}")


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """The device a collective of ``group`` takes tensors on when no payload says otherwise (NCCL: the current
    CUDA device, HCCL: the current NPU, else the CPU)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


class EPGroup:
    """R ranks of ``group``, of which ``live`` take part (see the module docstring).

    Arguments:
        group: the EP ProcessGroup.
        mask: `[R]` `torch.int32`, the Buffer's mask (shared; shrink mode sets failed ranks to 1).
        timeout: seconds per collective wait, or None (``DEEP_EP_NPU_TIMEOUT``, else 30 s).
        enable_shrink: on a rank failure, continue on the survivors instead of raising.
    """

    def __init__(
        self, group: dist.ProcessGroup, mask: torch.Tensor, timeout: float | None = None, enable_shrink: bool = False
    ) -> None:
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mask = mask
        self.timeout = resolve_timeout(timeout)
        self.enable_shrink = enable_shrink
        self.live: list[int] = list(range(self.num_ranks))
        self.comm: dist.ProcessGroup = group
        self._monitor: GroupMonitor | None = None

    @property
    def failed(self) -> list[int]:
        """Ranks removed from the group by shrink mode (they cannot be unmasked)."""
        return [r for r in range(self.num_ranks) if r not in self.live]

    @property
    def monitor(self) -> GroupMonitor:
        if self._monitor is None:
            self._monitor = monitor(self.comm)
        return self._monitor

    def _translate(self, err: EPRankFailure) -> EPRankFailure:
        if self.comm is self.group:
            return err
        new = EPRankFailure([self.live[r] for r in err.missing_ranks], err.op, err.timeout, err.excluded)
        new.__cause__ = err.__cause__
        return new

    # ---- bounded collectives over the live ranks -------------------------------------------------------------
    def start(self, launch: Callable[[dist.ProcessGroup], Any], op: str) -> Pending:
        """Issue ``launch(comm_group)`` (an ``async_op=True`` collective)."""
        try:
            return self.monitor.start(lambda: launch(self.comm), op, self.timeout)
        except EPRankFailure as err:
            raise self._translate(err) from err.__cause__

    def wait(self, pending: Pending, op: str) -> None:
        try:
            self.monitor.wait(pending, op, self.timeout)
        except EPRankFailure as err:
            raise self._translate(err) from err.__cause__

    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int], send_splits: Sequence[int], op: str
    ) -> Pending:
        """Start an uneven all-to-all of flat tensors with R-long split lists (failed ranks' entries must be 0)."""
        live = self.live
        out_splits, in_splits = [recv_splits[r] for r in live], [send_splits[r] for r in live]
        assert sum(out_splits) == sum(recv_splits) and sum(in_splits) == sum(send_splits), "failed ranks carry rows"

        def launch(group: dist.ProcessGroup) -> Any:
            return dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)

        return self.start(launch, op)

    def transfer(
        self, recv: torch.Tensor, send: torch.Tensor, recv_rows: Sequence[int], send_rows: Sequence[int], op: str
    ) -> Transfer:
        """Start moving `[rows, width]` uint8 ``send`` (``send_rows[r]`` rows for rank r, in rank order) into
        ``recv`` (``recv_rows[r]`` rows from rank r); :meth:`Transfer.wait` waits (bounded) for it."""
        return Transfer(self, recv, send, recv_rows, send_rows, op)

    def barrier(self, op: str) -> None:
        """A bounded barrier of the live ranks (in shrink mode, of the survivors after a failure)."""
        while True:
            try:
                self.wait(self.start(lambda group: dist.barrier(group=group, async_op=True), op), op)
                return
            except EPRankFailure as err:
                self.shrink(err)

    def start_agree(
        self,
        op: str,
        status: int,
        counts: Sequence[Sequence[int]],
        shared: Sequence[int],
        neutral: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> Callable[[], Agreement]:
        """Start the agreement step of a collective call: every rank sends every peer one int64 row
        ``[status, *counts[peer], *shared]`` (``counts``: one row of C ints per rank of the group, e.g. rows and pairs
        it will send there; ``shared``: the same for every peer, e.g. the fingerprint of the parameters all ranks must
        agree on). The row has the same width on every rank whatever the input, so a rank whose input was rejected
        still completes it, and every rank raises instead of waiting. Returns ``finish() -> Agreement`` (local work
        overlaps the round trip); ranks removed by shrink mode read as status 0, zero counts, ``neutral`` (default
        ``shared``). The tensor lives on ``device`` (the payload's; default the group's), read back once."""
        live, width = self.live, len(counts[0]) if counts else 0
        rows = [[status, *counts[r], *shared] for r in live]
        send = torch.tensor(rows, dtype=torch.int64).to(device or comm_device(self.comm))
        recv, pending, t0 = send, None, time.perf_counter()
        if len(live) > 1:
            recv = torch.empty_like(send)
            pending = self.start(lambda group: dist.all_to_all_single(recv, send, group=group, async_op=True), op)

        def finish() -> Agreement:
            if pending is not None:
                self.wait(pending, op)
            got = recv.tolist()
            wait_us = int((time.perf_counter() - t0) * 1e6)
            fill = [0, *([0] * width), *(shared if neutral is None else neutral)]
            table = [list(fill) for _ in range(self.num_ranks)]
            for i, rank in enumerate(live):
                table[rank] = got[i]
            return Agreement(
                [row[0] for row in table],
                [row[1 : 1 + width] for row in table],
                [tuple(row[1 + width :]) for row in table],
                wait_us,
                op,
            )

        return finish

    # ---- shrink mode --------------------------------------------------------------------------------------------
    def shrink(self, failure: EPRankFailure) -> None:
        """Drop ``failure.missing_ranks`` from the live set and continue on a new group of the survivors.

        Raises:
            EPRankFailure: shrink mode is off, this rank was itself excluded, or no rank is missing.
        """
        if not self.enable_shrink or failure.excluded or not failure.missing_ranks:
            raise failure
        survivors = [r for r in self.live if r not in failure.missing_ranks]
        all_ranks = dist.get_process_group_ranks(self.group)
        global_ranks = [all_ranks[r] for r in survivors]
        self.comm = _survivor_group(global_ranks, self.timeout)
        self._monitor = None
        self.live = survivors
        self.mask[list(failure.missing_ranks)] = 1

    def run(self, send: Callable[[], _R], rewind: Callable[[], None]) -> _R:
        """Run a backend call: ``send()`` runs its send phase and returns a result whose ``completion`` is the
        receive phase. In shrink mode a rank failure in either phase shrinks the group, calls ``rewind()`` (the
        backend's buffer indices go back, so the re-run writes the same result tensors) and re-runs ``send()``."""
        if not self.enable_shrink:
            return send()

        def sent() -> Any:
            while True:
                try:
                    return send()
                except EPRankFailure as err:
                    self.shrink(err)
                    rewind()

        result: Any = sent()
        first = result.completion

        def finish() -> None:
            current = first
            while True:
                try:
                    current.wait()
                    return
                except EPRankFailure as err:
                    self.shrink(err)
                    rewind()
                    current = sent().completion

        return result._replace(completion=Completion(finish))


class Transfer:
    """An in-flight uneven all-to-all of byte rows (nothing to do when no row crosses ranks)."""

    def __init__(
        self,
        ep: EPGroup,
        recv: torch.Tensor,
        send: torch.Tensor,
        recv_rows: Sequence[int],
        send_rows: Sequence[int],
        op: str,
    ) -> None:
        self.ep, self.op, self.wait_ns = ep, op, 0
        self._keep: tuple[torch.Tensor, torch.Tensor] | None = (recv, send)
        self.pending: Pending | None = None
        if ep.num_ranks > 1:
            width = send.shape[1] if send.dim() == 2 else recv.shape[1]
            self.pending = ep.all_to_all(
                recv.view(-1), send.reshape(-1), [r * width for r in recv_rows], [r * width for r in send_rows], op
            )

    def wait(self) -> int:
        """Wait for the rows (bounded by the group's timeout); returns the nanoseconds spent waiting."""
        if self.pending is not None:
            t0 = time.perf_counter_ns()
            pending, self.pending = self.pending, None
            self.ep.wait(pending, self.op)
            self.wait_ns = time.perf_counter_ns() - t0
        self._keep = None
        return self.wait_ns


def _survivor_group(global_ranks: list[int], timeout: float) -> dist.ProcessGroup:
    """A group of ``global_ranks`` built by them alone (an existing group of exactly those ranks is reused)."""
    for pg in dist.distributed_c10d._world.pg_names:
        if dist.get_process_group_ranks(pg) == global_ranks:
            return pg
    group = dist.new_group(
        ranks=global_ranks, timeout=datetime.timedelta(seconds=timeout), use_local_synchronization=True
    )
    assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER, "only survivors shrink"
    return group


_GROUPS: dict[int, tuple[dist.ProcessGroup, EPGroup]] = {}


def ep_group(group: dist.ProcessGroup) -> EPGroup:
    """The :class:`EPGroup` the ops use for ``group`` when no Buffer owns one (timeout: ``DEEP_EP_NPU_TIMEOUT``,
    else the default; no shrink); one per group per process."""
    cached = _GROUPS.get(id(group))
    if cached is None or cached[0] is not group:
        size = dist.get_world_size(group)
        cached = (group, EPGroup(group, torch.zeros((size,), dtype=torch.int32), None))
        _GROUPS[id(group)] = cached
    return cached[1]
