""":class:`BufferComm`: an MoE layer's dispatch/combine through ``deep_ep_npu.Buffer`` low-latency calls over a process
group, whose members the driver sets at step boundaries (elastic mode: :meth:`BufferComm.regroup`).

Membership is never changed inside a call: the Buffer is built without shrink mode, so a rank failure raises
``EPRankFailure`` out of the step (nothing sampled) on every rank that meets it, and the driver, which alone decides
who is lost (a rank that does not answer it), tells every survivor the same members before the step runs again.
Survivors that met the failure in different collectives, or not at all, so never disagree on who is left (per-call
shrinking did: a survivor could be excluded as failed, taking the last replicas of its experts with it).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deep_ep_npu import Buffer
from deep_ep_npu.eplb import ExpertMap
from deep_ep_npu.transports.failure import resolve_timeout

from .ep_comm import ExpertComm

logger = logging.getLogger("server.moe")


class BufferComm(ExpertComm):
    """``deep_ep_npu.Buffer`` low-latency dispatch/combine over ``group`` (exact: ``use_fp8=False``).

    The slots keep their numbering over the ``num_ranks`` ranks of ``group`` (rank r holds slots ``[r * L, (r + 1) *
    L)``) for the comm's whole life; after :meth:`regroup` the Buffer spans only the members, and ids are renumbered
    into its slots on the way in (:meth:`to_physical`). ``timeout`` goes to the Buffer (a bound on each collective
    wait). Dispatch and combine are issued with ``return_recv_hook=True`` (DeepEP's hook-based overlap):
    :meth:`dispatch_start` / :meth:`combine_start` run the send phase and return the receive; shared experts run
    between a combine's two phases (and two micro-batches' dense parts: ``two_batch.py``). ``fused=True`` makes the MoE
    layers built on it use :meth:`fused_moe` (``Buffer.mega_moe``: dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine).
    """

    def __init__(
        self,
        group: Any,
        num_experts: int,
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        backend: str = "auto",
        timeout: float | None = None,
        fused: bool = False,
        expert_map: ExpertMap | None = None,
        num_moe_layers: int = 1,
    ) -> None:
        super().__init__(
            dist.get_rank(group), dist.get_world_size(group), num_experts, num_max_dispatch_tokens_per_rank, expert_map
        )
        self.group, self.hidden, self.backend = group, hidden, backend
        self.timeout = resolve_timeout(timeout)  # (None: the library's default, as the Buffer would take it)
        self.num_moe_layers = num_moe_layers
        self.members = list(range(self.num_ranks))  # the EP ranks the Buffer spans
        self._renumber: torch.Tensor | None = None  # `[P]` int64: slot -> the Buffer's slot (-1: a lost rank's)
        self._renumbered: dict[torch.device, torch.Tensor] = {}
        self.buffer = self._new_buffer(group)
        self.fused = fused

    def _new_buffer(self, group: Any) -> Buffer:
        size = dist.get_world_size(group)
        n, slots = self.num_max_dispatch_tokens_per_rank, size * self.num_local_experts
        return Buffer(
            group,
            num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(n, self.hidden, size, slots),
            low_latency_mode=True,
            num_qps_per_rank=self.num_local_experts,
            explicitly_destroy=True,
            backend=self.backend,
            timeout=self.timeout,
        )

    @property
    def num_buffer_experts(self) -> int:
        """The slots the Buffer spans: L per member."""
        return len(self.members) * self.num_local_experts

    def regroup(self, members: list[int]) -> None:
        """Continue on ``members`` (EP ranks, this one among them; every member calls this with the same list, at the
        same step boundary): a new process group of them and a new Buffer (the old one is released without waiting
        for its peers); the other ranks' slots leave the placement, their experts' tokens go to surviving replicas,
        and experts left without one are dropped (:attr:`lost_experts`). Collective over ``members``."""
        assert self.rank in members and set(members) <= set(self.members), (self.rank, members, self.members)
        per = self.num_local_experts
        self.buffer.destroy()
        lost = set(range(self.num_ranks)) - set(members)
        if lost != self.lost_ranks:
            self.lost_ranks = lost
            if self.expert_map is not None:
                self.expert_map, self.lost_experts = self.expert_map.without_ranks(lost)
            else:
                gone = sorted(e for r in lost for e in range(r * per, (r + 1) * per))
                self.lost_experts = [gone] * self.num_moe_layers
            dropped = {layer: gone for layer, gone in enumerate(self.lost_experts) if gone}
            logger.warning(
                "rank %d: EP ranks %s lost; their experts' tokens go to the surviving replicas; experts "
                "with no replica left (dropped), by MoE layer: %s",
                self.rank,
                sorted(lost),
                dropped or "none",
            )
        timeout = datetime.timedelta(seconds=self.timeout)
        group = dist.new_group(ranks=members, timeout=timeout, use_local_synchronization=True)
        self.group, self.members = group, list(members)
        self.buffer = self._new_buffer(group)
        renumber = torch.full((self.num_physical,), -1, dtype=torch.int64)
        for i, r in enumerate(members):
            renumber[r * per : (r + 1) * per] = torch.arange(i * per, (i + 1) * per)
        self._renumber = None if members == list(range(self.num_ranks)) else renumber
        self._renumbered.clear()

    def to_physical(self, layer: int, topk_idx: torch.Tensor) -> torch.Tensor:
        """Logical ids `[num_tokens, k]` int64 -> the Buffer's slot ids (-1: dropped: an expert with no live copy)."""
        ids = super().to_physical(layer, topk_idx)
        if self._renumber is None:
            return ids
        if ids.device not in self._renumbered:
            self._renumbered[ids.device] = self._renumber.to(ids.device)
        return torch.where(ids >= 0, self._renumbered[ids.device][ids.clamp(min=0)], -1)

    def fused_moe(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * FFN_e(x[t])`` via ``Buffer.mega_moe`` (timed as dispatch).

        Arguments:
            x: `[num_tokens, hidden]`; topk_idx `[num_tokens, num_topk]` int64; topk_weights `torch.float32`.
            w1: `[num_local_experts, hidden, 2 * I]` (gate columns, then up); w2: `[num_local_experts, I, hidden]`.
        """
        t0 = time.perf_counter()
        out = self.buffer.mega_moe(
            x,
            topk_idx,
            topk_weights,
            w1,
            w2,
            num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
            num_experts=self.num_buffer_experts,
            out_dtype=x.dtype,
        )
        self.stats.dispatch += time.perf_counter() - t0
        return out

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.dispatch_start(x, topk_idx, num_tokens_all_ranks)()

    def dispatch_start(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, Any]]:
        """:meth:`dispatch`'s send phase now (``return_recv_hook``); returns its receive, which returns what
        :meth:`dispatch` does."""
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x,
            topk_idx,
            self.num_max_dispatch_tokens_per_rank,
            self.num_buffer_experts,
            use_fp8=False,
            return_recv_hook=True,
        )
        assert hook is not None, "return_recv_hook=True returns the hook"

        def receive() -> tuple[torch.Tensor, torch.Tensor, Any]:
            hook()
            num_local, capacity, hidden = recv_x.shape
            senders = len(self.members) * self.num_max_dispatch_tokens_per_rank
            senders = senders if num_tokens_all_ranks is None else num_tokens_all_ranks
            num_rows = min(num_local * capacity, senders * min(topk_idx.shape[1], num_local))
            offsets = torch.cumsum(recv_count, 0, dtype=torch.int32)
            row = torch.arange(num_rows, device=x.device)
            expert = torch.searchsorted(offsets, row, right=True).clamp_(max=num_local - 1)
            src = expert * capacity + row - (offsets - recv_count)[expert]
            valid = row < offsets[-1]
            rows = recv_x.reshape(-1, hidden).index_select(0, torch.where(valid, src, 0))
            dst = torch.where(valid, src, num_local * capacity)  # padding rows go to a scratch row past the layout
            return rows, offsets, (handle, dst, recv_x.shape)

        return receive

    def combine(self, expert_out, topk_idx, topk_weights, handle, overlap=None):  # noqa: ANN001
        receive = self.combine_start(expert_out, topk_idx, topk_weights, handle)
        shared = None if overlap is None else overlap()
        return receive(), shared

    def combine_start(
        self, expert_out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any
    ) -> Callable[[], torch.Tensor]:
        """:meth:`combine`'s send phase now (``return_recv_hook``: DeepEP's hook-based overlap); returns its
        receive, which returns the combined rows."""
        handle, dst, shape = handle
        masked = expert_out.new_empty(shape[0] * shape[1] + 1, shape[2]).index_copy_(0, dst, expert_out)
        expert_out = masked[:-1].view(shape)  # DeepEP's masked layout; rows past each count are never read
        combined, _, hook = self.buffer.low_latency_combine(
            expert_out, topk_idx, topk_weights, handle, return_recv_hook=True, slot_order=True
        )
        assert hook is not None, "return_recv_hook=True returns the hook"

        def receive() -> torch.Tensor:
            hook()
            return combined

        return receive

    def destroy(self) -> None:
        self.buffer.destroy()
