"""How an MoE layer moves tokens to its experts and back: one small ABC, two implementations.

- :class:`LocalComm`: one rank holds every expert; sorts the (token, expert) pairs by expert in process.
- :class:`~.buffer_comm.BufferComm`: ``deep_ep_npu.Buffer`` low-latency dispatch/combine over a process group;
  DeepEP's masked layout is packed into the grouped one on the device (no count is read back on the host).

Both hand the experts the grouped-GEMM layout (``torch._grouped_mm``'s): the received rows `[num_rows, hidden]`,
expert ``e``'s in ``[offsets[e - 1], offsets[e])``, so the expert code is one grouped matmul per projection.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import torch

from deep_ep_npu import kernels
from deep_ep_npu.eplb import ExpertMap


class CommStats:
    """Seconds spent in dispatch and combine since the last :meth:`reset` (summed over MoE layers)."""

    def __init__(self) -> None:
        self.dispatch = 0.0
        self.combine = 0.0

    def reset(self) -> None:
        self.dispatch = self.combine = 0.0


class ExpertComm(abc.ABC):
    """Dispatch/combine for one EP group. ``num_max_dispatch_tokens_per_rank`` is the per-step token capacity N.

    ``fused``: the MoE layers built on this comm call :meth:`fused_moe` instead of dispatch -> experts -> combine
    (read once, when the model is built)."""

    fused: bool = False

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        num_experts: int,
        num_max_dispatch_tokens_per_rank: int,
        expert_map: ExpertMap | None = None,
    ) -> None:
        if expert_map is None and num_experts % num_ranks != 0:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the EP size {num_ranks} (or add "
                "redundant slots: --num-redundant-experts / --expert-placement)"
            )
        if expert_map is not None and (expert_map.num_logical, expert_map.num_ranks) != (num_experts, num_ranks):
            raise ValueError(
                f"the expert placement is for {expert_map.num_logical} experts on "
                f"{expert_map.num_ranks} ranks; the model has {num_experts} on {num_ranks}"
            )
        self.rank, self.num_ranks, self.num_experts = rank, num_ranks, num_experts
        self.expert_map = expert_map
        self.num_physical = num_experts if expert_map is None else expert_map.num_physical
        self.num_local_experts = self.num_physical // num_ranks
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.stats = CommStats()
        self.load: torch.Tensor | None = None  # `[moe layers, num_local_experts]` int64: rows received per slot
        self.lost_experts: list[list[int]] = []  # per MoE layer: experts with no replica left (lost ranks)
        self.lost_ranks: set[int] = set()  # EP ranks this comm no longer exchanges with (elastic mode)

    @property
    def local_expert_ids(self) -> range:
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    def local_experts(self, layer: int) -> list[int]:
        """The logical expert of each of this rank's slots in MoE layer ``layer`` (-1: an empty slot)."""
        if self.expert_map is None:
            return list(self.local_expert_ids)
        return self.expert_map.local_experts(layer, self.rank)

    def to_physical(self, layer: int, topk_idx: torch.Tensor) -> torch.Tensor:
        """``topk_idx`` `[num_tokens, k]` int64 logical ids -> the ids the exchange runs on (physical slots with a
        placement: :meth:`deep_ep_npu.eplb.ExpertMap.to_physical`; else the same tensor)."""
        return topk_idx if self.expert_map is None else self.expert_map.to_physical(layer, topk_idx, self.rank)

    def set_expert_map(self, expert_map: ExpertMap) -> None:
        """Switch to ``expert_map`` (same P and ranks) at a step boundary (EPLB), after the weights moved."""
        assert self.expert_map is not None and expert_map.num_physical == self.num_physical
        self.expert_map = expert_map

    def record_load(self, layer: int, num_layers: int, offsets: torch.Tensor) -> None:
        """Add the rows each local slot received (``offsets`` `[num_local_experts]` int32, cumulative: the
        dispatch's receive counts, no extra communication) to :attr:`load` `[num_layers, num_local_experts]`."""
        if self.load is None:
            self.load = torch.zeros(num_layers, self.num_local_experts, dtype=torch.int64, device=offsets.device)
        self.load[layer] += torch.diff(offsets, prepend=offsets.new_zeros(1))

    def take_load(self) -> torch.Tensor | None:
        """:attr:`load` on the CPU, then started afresh (None when no MoE layer ran since the last call)."""
        out, self.load = self.load, None  # (made under inference mode: replaced, not zeroed)
        return None if out is None else out.cpu()

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each token to its experts.

        Arguments:
            x: `[num_tokens, hidden]`, `num_tokens <= num_max_dispatch_tokens_per_rank` (0 allowed).
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, global expert ids (-1: none).
            num_tokens_all_ranks: this step's tokens summed over the EP ranks (bounds ``num_rows``), or None.

        Returns:
            recv_rows: `[num_rows, hidden]`, dtype of `x`: local expert ``e``'s rows are ``[offsets[e - 1],
                offsets[e])``; rows from ``offsets[-1]`` on are padding with undefined values.
            offsets: `[num_local_experts]` with `torch.int32`, the cumulative row counts.
            handle: opaque, for :meth:`combine`.
        """

    @abc.abstractmethod
    def combine(
        self,
        expert_out: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: Any,
        overlap: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return each token's weighted sum over its experts, and ``overlap()``'s result (run while the combine's
        receive is pending where the backend allows it).

        Arguments:
            expert_out: `[num_rows, hidden]`, the expert outputs in `recv_rows`' layout (padding rows ignored).
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, as given to :meth:`dispatch`.
            topk_weights: `[num_tokens, num_topk]` with `torch.float32`.

        Returns:
            combined_x: `[num_tokens, hidden]`, dtype of `expert_out`; the overlap result or None.
        """

    def dispatch_start(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, Any]]:
        """:meth:`dispatch` in two phases: the send now, the receive in the returned call (which returns what
        :meth:`dispatch` does); here both run now, a backend with an asynchronous receive overrides it."""
        out = self.dispatch(x, topk_idx, num_tokens_all_ranks)
        return lambda: out

    def combine_start(
        self, expert_out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any
    ) -> Callable[[], torch.Tensor]:
        """:meth:`combine` in two phases, as :meth:`dispatch_start` (the returned call returns combined_x)."""
        combined, _ = self.combine(expert_out, topk_idx, topk_weights, handle)
        return lambda: combined

    def timed_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        t0 = time.perf_counter()
        out = self.dispatch(x, topk_idx, num_tokens_all_ranks)
        self.stats.dispatch += time.perf_counter() - t0
        return out

    def timed_combine(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        t0 = time.perf_counter()
        out = self.combine(*args, **kwargs)
        self.stats.combine += time.perf_counter() - t0
        return out


class LocalComm(ExpertComm):
    """Single rank, every expert local: the (token, expert) pairs sorted by expert (pairs without an expert last,
    past ``offsets[-1]``)."""

    def __init__(self, num_experts: int, num_max_dispatch_tokens_per_rank: int) -> None:
        super().__init__(0, 1, num_experts, num_max_dispatch_tokens_per_rank)
        self._experts: dict[torch.device, torch.Tensor] = {}  # arange(num_experts) per device, for the offsets

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        experts = topk_idx.reshape(-1)
        experts, order = torch.sort(torch.where(experts >= 0, experts, self.num_experts), stable=True)
        if x.device not in self._experts:
            self._experts[x.device] = torch.arange(self.num_experts, device=x.device)
        offsets = torch.searchsorted(experts, self._experts[x.device], right=True, out_int32=True)
        tokens = torch.div(order, topk_idx.shape[1], rounding_mode="floor")
        return x[tokens], offsets, (order, tokens, experts < self.num_experts, offsets)

    def combine(self, expert_out, topk_idx, topk_weights, handle, overlap=None):  # noqa: ANN001
        order, tokens, valid, offsets = handle
        weights = topk_weights.reshape(-1)[order]
        out = torch.empty(topk_idx.shape[0], expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        n = int(offsets[-1]) if expert_out.is_cpu and len(offsets) else -1  # the valid pairs, first (sorted by expert)
        if n < 0 or not kernels.accumulate(out, expert_out[:n], None, tokens[:n], weights[:n], zero_first=True):
            rows = torch.where(valid[:, None], expert_out.float() * weights[:, None], 0.0)  # padding may hold NaN
            out.zero_().index_add_(0, tokens, rows)
        return out.to(expert_out.dtype), (overlap() if overlap is not None else None)
