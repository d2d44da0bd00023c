"""Baselines measured in the same run as our dispatch/combine (see bench_low_latency.py).

- ``a2a_floor``: one uneven ``all_to_all_single`` of ``uint8`` moving exactly the bytes our op puts on the wire,
  the floor for any collective-based implementation.
- ``allgather_rs``: the portable fallback engines use without an EP library (vLLM's AgRs): all-gather tokens,
  top-k ids and weights, every rank applies its local experts (identity here) to every token routed to them and
  weights them, then a reduce-scatter returns each rank its tokens' sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class A2AFloor:
    """An all_to_all_single of fixed per-destination byte counts (the receive counts are exchanged once, untimed)."""

    def __init__(self, send_bytes_per_rank: list[int], group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        w = len(send_bytes_per_rank)
        send_counts = torch.tensor(send_bytes_per_rank, dtype=torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        self.send_splits = send_counts.tolist()
        self.recv_splits = recv_counts.tolist()
        self.send = torch.randint(0, 255, (sum(self.send_splits),), dtype=torch.uint8)
        self.recv = torch.empty((sum(self.recv_splits),), dtype=torch.uint8)
        assert w == dist.get_world_size(group)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends to other ranks (its own share stays local)."""
        return sum(self.send_splits) - self.send_splits[dist.get_rank(self.group)]

    def __call__(self) -> torch.Tensor:
        dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits, group=self.group)
        return self.recv


class AllGatherReduceScatter:
    """AgRs dispatch (all-gather x, topk_idx, topk_weights) and combine (weighted local sum + reduce-scatter).

    Identity experts, so the combined result is ``x * sum of the weights of the pairs routed anywhere``; every rank
    must have the same number of tokens (pad otherwise), as all_gather_into_tensor requires.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_experts // self.world_size

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        w = self.world_size
        all_x = x.new_empty((w * x.shape[0], x.shape[1]))
        all_idx = topk_idx.new_empty((w * topk_idx.shape[0], topk_idx.shape[1]))
        all_w = topk_weights.new_empty((w * topk_weights.shape[0], topk_weights.shape[1]))
        dist.all_gather_into_tensor(all_x, x, group=self.group)
        dist.all_gather_into_tensor(all_idx, topk_idx, group=self.group)
        dist.all_gather_into_tensor(all_w, topk_weights, group=self.group)
        return all_x, all_idx, all_w

    def combine(self, all_x: torch.Tensor, all_idx: torch.Tensor, all_w: torch.Tensor) -> torch.Tensor:
        lo = self.rank * self.num_local_experts
        local = (all_idx >= lo) & (all_idx < lo + self.num_local_experts)
        weight = (all_w * local).sum(dim=1, keepdim=True)  # identity experts: sum_k w * x over local pairs
        partial = (all_x.float() * weight).to(all_x.dtype)
        out = all_x.new_empty((all_x.shape[0] // self.world_size, all_x.shape[1]))
        dist.reduce_scatter_tensor(out, partial, group=self.group)
        return out

    @staticmethod
    def wire_bytes(x: torch.Tensor, topk_idx: torch.Tensor, world_size: int) -> tuple[int, int]:
        """(dispatch, combine) bytes one rank sends to others (ring all-gather / reduce-scatter volumes)."""
        per_rank = x.numel() * x.element_size() + topk_idx.numel() * (topk_idx.element_size() + 4)
        return per_rank * (world_size - 1), x.numel() * x.element_size() * (world_size - 1)


class MemcpyFloor:
    """One ``copy_`` of ``nbytes`` between two preallocated CPU buffers: the memory-speed floor of an op that must
    write that many bytes."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.wire_bytes = nbytes

    def __call__(self) -> None:
        self.dst.copy_(self.src)
