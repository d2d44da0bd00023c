"""The EP group (:class:`EPGroup`): its ranks' membership, shrink mode and the agreement step, on the bounded
collectives of :class:`~.collective.Communicator`.

The EP group's R ranks keep their numbers for a buffer's whole life (the mask stays `[R]`). Collectives run on the
*live* ranks: all R at first; after a failure in shrink mode, the survivors (agreed through :mod:`.failure`) build a
group of themselves, mark the failed ranks in the mask and re-run the interrupted call; R-long split lists and headers
drop the failed ranks' entries (0) on the way in and read zeros for them on the way out.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from .agreement import Agreement
from .collective import Communicator, Pending
from .failure import EPRankFailure

_R = TypeVar("_R")


class EPGroup(Communicator):
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
        super().__init__(group, mask, timeout)
        self.enable_shrink = enable_shrink

    @property
    def failed(self) -> list[int]:
        """Ranks removed by shrink mode (they cannot be unmasked)."""
        return [r for r in range(self.num_ranks) if r not in self.live]

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
