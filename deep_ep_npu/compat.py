"""What DeepEP's legacy ``Buffer`` has beyond the low-latency calls, in one place (:class:`DeepEPCompat`, a mixin of
:class:`deep_ep_npu.Buffer`): arguments and methods accepted for compatibility that change nothing here (SMs, the
communication stream, ``capture``), the normal (high-throughput) mode as far as it exists (``Config``, accepted;
``get_dispatch_layout``, a local computation; a clear error for normal-mode ``dispatch`` / ``combine``, whose job
DeepEP V2's :class:`~deep_ep_npu.ElasticBuffer` does: one ``dispatch`` / ``combine`` pair for prefill and decode, on
this library's engine)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .core import rules
from .errors import shape
from .handle import EventOverlap

NORMAL_MODE_HINT = (
    "the normal (high-throughput) mode of deep_ep.Buffer is not implemented by deep_ep_npu: use "
    "deep_ep_npu.ElasticBuffer (DeepEP V2's dispatch / combine, the same job for prefill and decode; see the "
    "README's 'Coming from DeepEP V2'), or low_latency_dispatch / low_latency_combine"
)


@dataclasses.dataclass
class Config:
    """DeepEP's ``Config`` (normal-mode kernel tuning: SMs and chunk sizes): accepted for compatibility, unused (the
    normal-mode kernels it tunes do not exist here). The size hints return 0 (buffers are sized on demand)."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def normal_mode_error(method: str) -> NotImplementedError:
    return NotImplementedError(f"Buffer.{method}: {NORMAL_MODE_HINT}")


def get_dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, Any]:
    """DeepEP's ``get_dispatch_layout`` (local, no communication). ``topk_idx``: `[T, K]` `torch.int64` /
    `torch.int32`, ids in ``[0, num_experts)`` or -1. Returns ``num_tokens_per_rank`` `[R]` `torch.int32` (tokens
    with at least one expert on each rank), ``num_tokens_per_rdma_rank`` None (no RDMA domain here),
    ``num_tokens_per_expert`` `[num_experts]` `torch.int32`, ``is_token_in_rank`` `[T, R]` `torch.bool` and a
    complete :class:`EventOverlap`; all on ``topk_idx``'s device."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise shape("num_experts", f"must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise shape("num_experts", f"{num_experts} is not divisible by num_ranks = {num_ranks}")
    idx = rules.tensor(topk_idx, "topk_idx", (torch.int32, torch.int64), 2)
    idx = rules.expert_ids(idx, "topk_idx", num_experts, idx.shape[0], rules.MAX_TOPK * 2, no_expert=True).long()
    valid = idx >= 0
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros((idx.shape[0], num_ranks + 1), dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, rank_of, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    return is_token_in_rank.sum(dim=0).to(torch.int32), None, per_expert, is_token_in_rank, EventOverlap(None)
