"""How an MoE layer moves tokens to its experts and back: one small ABC, two implementations.

- :class:`LocalComm`: one rank holds every expert; builds DeepEP's masked layout in process (no communication).
- :class:`BufferComm`: ``deep_ep_npu.Buffer`` low-latency dispatch/combine over a process group.

Both return DeepEP's low-latency layout, so the expert code is the same: ``recv_x`` ``[num_local_experts,
num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` whose first ``recv_count[e]`` rows of expert ``e`` are valid.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import torch


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

    def __init__(self, rank: int, num_ranks: int, num_experts: int, num_max_dispatch_tokens_per_rank: int) -> None:
        if num_experts % num_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP size {num_ranks}")
        self.rank, self.num_ranks, self.num_experts = rank, num_ranks, num_experts
        self.num_local_experts = num_experts // num_ranks
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.stats = CommStats()

    @property
    def local_expert_ids(self) -> range:
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each token to its experts.

        Arguments:
            x: `[num_tokens, hidden]`, `num_tokens <= num_max_dispatch_tokens_per_rank` (0 allowed).
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, global expert ids (-1: none).

        Returns:
            recv_x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`, dtype of `x`.
            recv_count: `[num_local_experts]` with `torch.int32`.
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
            expert_out: `[num_local_experts, num_ranks * N, hidden]`, the expert outputs in `recv_x`'s layout.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, as given to :meth:`dispatch`.
            topk_weights: `[num_tokens, num_topk]` with `torch.float32`.

        Returns:
            combined_x: `[num_tokens, hidden]`, dtype of `expert_out`; the overlap result or None.
        """

    def timed_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        t0 = time.perf_counter()
        out = self.dispatch(x, topk_idx)
        self.stats.dispatch += time.perf_counter() - t0
        return out

    def timed_combine(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        t0 = time.perf_counter()
        out = self.combine(*args, **kwargs)
        self.stats.combine += time.perf_counter() - t0
        return out


class LocalComm(ExpertComm):
    """Single rank, every expert local: the masked layout is built by a stable sort on expert id."""

    def __init__(self, num_experts: int, num_max_dispatch_tokens_per_rank: int) -> None:
        super().__init__(0, 1, num_experts, num_max_dispatch_tokens_per_rank)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        n, h = self.num_max_dispatch_tokens_per_rank, x.shape[1]
        flat = topk_idx.reshape(-1)
        slots = torch.nonzero(flat >= 0).flatten()
        experts = flat[slots]
        order = torch.argsort(experts, stable=True)
        slots, experts = slots[order], experts[order]
        counts = torch.bincount(experts, minlength=self.num_experts)
        offsets = torch.cumsum(counts, 0) - counts
        pos = torch.arange(slots.numel(), device=x.device) - offsets[experts]
        tokens = torch.div(slots, topk_idx.shape[1], rounding_mode="floor")
        recv_x = x.new_empty(self.num_experts, n, h)  # rows past each expert's count stay uninitialised
        recv_x[experts, pos] = x[tokens]
        return recv_x, counts.to(torch.int32), (slots, experts, pos)

    def combine(self, expert_out, topk_idx, topk_weights, handle, overlap=None):  # noqa: ANN001
        slots, experts, pos = handle
        num_tokens, num_topk = topk_idx.shape
        rows = expert_out[experts, pos].float() * topk_weights.reshape(-1)[slots, None]
        out = torch.zeros(num_tokens, expert_out.shape[2], dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, torch.div(slots, num_topk, rounding_mode="floor"), rows)
        return out.to(expert_out.dtype), (overlap() if overlap is not None else None)


class BufferComm(ExpertComm):
    """``deep_ep_npu.Buffer`` low-latency dispatch/combine over ``group`` (exact: ``use_fp8=False``).

    ``enable_shrink`` / ``timeout`` go to the Buffer (a lost rank's experts are then dropped, see the Buffer).
    With shared experts, combine is issued with ``return_recv_hook=True``: the send phase runs, the shared experts
    are computed, then ``hook()`` receives (DeepEP's hook-based overlap). ``fused=True`` makes the MoE layers built
    on it use :meth:`fused_moe` (``Buffer.mega_moe``: dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one call).
    """

    def __init__(self, group: Any, num_experts: int, num_max_dispatch_tokens_per_rank: int, hidden: int,
                 backend: str = "auto", enable_shrink: bool = False, timeout: float | None = None,
                 fused: bool = False) -> None:  # fmt: skip
        import torch.distributed as dist

        from deep_ep_npu import Buffer

        super().__init__(
            dist.get_rank(group), dist.get_world_size(group), num_experts, num_max_dispatch_tokens_per_rank
        )
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, self.num_ranks, num_experts
        )
        self.buffer = Buffer(
            group,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=self.num_local_experts,
            explicitly_destroy=True,
            backend=backend,
            enable_shrink=enable_shrink,
            timeout=timeout,
        )
        self.fused = fused

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
            x, topk_idx, topk_weights, w1, w2,
            num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
            num_experts=self.num_experts, out_dtype=x.dtype,
        )  # fmt: skip
        self.stats.dispatch += time.perf_counter() - t0
        return out

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, topk_idx, self.num_max_dispatch_tokens_per_rank, self.num_experts, use_fp8=False
        )
        return recv_x, recv_count, handle

    def combine(self, expert_out, topk_idx, topk_weights, handle, overlap=None):  # noqa: ANN001
        if overlap is None:
            combined, _, _ = self.buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
            return combined, None
        combined, _, hook = self.buffer.low_latency_combine(
            expert_out, topk_idx, topk_weights, handle, return_recv_hook=True
        )
        shared = overlap()
        assert hook is not None, "return_recv_hook=True returns the hook"
        hook()
        return combined, shared

    def destroy(self) -> None:
        self.buffer.destroy()
