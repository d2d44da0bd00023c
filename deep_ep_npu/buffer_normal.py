"""DeepEP's normal (high-throughput) mode on :class:`deep_ep_npu.Buffer`, as far as it exists here: ``Config``, a local
``get_dispatch_layout``, and ``dispatch`` / ``combine`` raising NotImplementedError that points to
:class:`~deep_ep_npu.ElasticBuffer` (which does their job). A mixin of :class:`deep_ep_npu.Buffer`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .backends import Backend
from .core import rules
from .handle import EventOverlap

NORMAL_MODE = (
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


class NormalModeMethods:
    """The normal-mode methods of :class:`deep_ep_npu.Buffer` (see the module docstring)."""

    _backend: Backend
    group_size: int
    num_sms: int = 20  # DeepEP's default (set_num_sms changes it)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Accepted for compatibility (DeepEP's normal kernels only; nothing to set here)."""
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be even, got {new_num_sms}")
        NormalModeMethods.num_sms = new_num_sms

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None, async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, Any]:  # fmt: skip
        """DeepEP's normal-mode layout, computed locally. ``topk_idx``: `[T, K]` `torch.int64` / `torch.int32`, ids in
        ``[0, num_experts)`` or -1. Returns ``num_tokens_per_rank`` `[R]` `torch.int32` (tokens with an expert on each
        rank), ``num_tokens_per_rdma_rank`` None, ``num_tokens_per_expert`` `[num_experts]` `torch.int32`,
        ``is_token_in_rank`` `[T, R]` `torch.bool` and a complete :class:`EventOverlap`, on ``topk_idx``'s device."""
        self._backend.check_alive(self)
        r, num_local = self.group_size, rules.plain_experts(self.group_size, 0, num_experts, "num_experts").num_local
        idx = rules.tensor(topk_idx, "topk_idx", (torch.int32, torch.int64), 2)
        idx = rules.expert_ids(idx, "topk_idx", num_experts, idx.shape[0], rules.MAX_TOPK * 2, no_expert=True).long()
        valid = idx >= 0
        per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
        in_rank = torch.zeros((idx.shape[0], r + 1), dtype=torch.bool, device=idx.device)
        in_rank.scatter_(1, torch.where(valid, idx // num_local, r), True)
        is_token_in_rank = in_rank[:, :r].contiguous()
        return is_token_in_rank.sum(dim=0).to(torch.int32), None, per_expert, is_token_in_rank, EventOverlap(None)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """Normal-mode dispatch: not implemented; raises NotImplementedError pointing to :class:`ElasticBuffer`."""
        raise NotImplementedError(f"Buffer.dispatch: {NORMAL_MODE}")

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        """Normal-mode combine: not implemented; raises NotImplementedError pointing to :class:`ElasticBuffer`."""
        raise NotImplementedError(f"Buffer.combine: {NORMAL_MODE}")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A default :class:`Config` (accepted by nothing here: normal mode is not implemented)."""
        return Config()

    get_combine_config = get_dispatch_config
