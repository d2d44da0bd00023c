"""The communicator behind a Buffer backend: bounded collectives over the EP group, and shrink mode.

The EP group's R ranks keep their numbers for the Buffer's whole life (``recv_x`` stays `[L, R * N, hidden]`,
the mask stays `[R]`). Collectives run on the *live* ranks: all R at first; after a failure in shrink mode
(``enable_shrink=True``) the survivors, who agreed on the failed set (:mod:`deep_ep_npu.failure`), build a new
group of themselves with ``torch.distributed.new_group(ranks=survivors, use_local_synchronization=True)``
(torch.distributed's own rendezvous, only survivors call it), mark the failed ranks in the mask, and re-run the
interrupted call there. Per-rank split lists and headers stay R long; the failed ranks' entries are dropped on the
way in (they are 0: masked ranks send and receive nothing) and filled with a neutral value on the way out.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .event import Completion
from .failure import EPRankFailure, GroupMonitor, Pending, monitor, resolve_timeout
from .ops import comm

_R = TypeVar("_R")


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

    def barrier(self, op: str) -> None:
        """A bounded barrier of the live ranks (in shrink mode, of the survivors after a failure)."""
        while True:
            try:
                self.wait(self.start(lambda group: dist.barrier(group=group, async_op=True), op), op)
                return
            except EPRankFailure as err:
                self.shrink(err)

    def exchange_header(
        self,
        status: int,
        rows_per_dest: Sequence[int],
        pairs_per_dest: Sequence[int],
        fingerprint: Sequence[int],
        neutral_fingerprint: Sequence[int],
        op: str,
    ) -> comm.Header:
        """:func:`deep_ep_npu.ops.comm.exchange_header` over the live ranks; failed ranks read as status 0, no rows,
        ``neutral_fingerprint``."""
        return self.start_header(status, rows_per_dest, pairs_per_dest, fingerprint, neutral_fingerprint, op)()

    def start_header(
        self,
        status: int,
        rows_per_dest: Sequence[int],
        pairs_per_dest: Sequence[int],
        fingerprint: Sequence[int],
        neutral_fingerprint: Sequence[int],
        op: str,
    ) -> Callable[[], comm.Header]:
        """Start :meth:`exchange_header` and return ``finish() -> Header``, so local work overlaps its round trip."""
        live = self.live
        send = comm.header_tensor(
            status, [rows_per_dest[r] for r in live], [pairs_per_dest[r] for r in live], fingerprint
        )
        recv, pending, t0 = send, None, time.perf_counter()
        if len(live) > 1:
            recv = torch.empty_like(send)
            pending = self.start(lambda group: dist.all_to_all_single(recv, send, group=group, async_op=True), op)

        def finish() -> comm.Header:
            if pending is not None:
                self.wait(pending, op)
            h = comm.parse_header(recv, int((time.perf_counter() - t0) * 1e6))
            if len(live) == self.num_ranks:
                return h
            r = self.num_ranks
            out = comm.Header([0] * r, [0] * r, [0] * r, [tuple(neutral_fingerprint)] * r, h.wait_us)
            for i, rank in enumerate(live):
                out.status[rank], out.rows[rank], out.pairs[rank] = h.status[i], h.rows[i], h.pairs[i]
                out.fingerprint[rank] = h.fingerprint[i]
            return out

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
