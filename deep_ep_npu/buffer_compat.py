"""The static and compatibility surface of :class:`deep_ep_npu.Buffer`: buffer size hints and DeepEP's helpers.

``get_low_latency_rdma_size_hint`` is DeepEP's formula (``LowLatencyLayout`` in its ``csrc/config.hpp``),
``get_low_latency_ccl_buffer_size`` ops-transformer's (MB). ``set_num_sms``, ``capture``, ``is_sm90_compiled`` and
``get_comm_stream`` exist so DeepEP code runs unchanged; there are no SMs or communication streams to control here.
"""

from __future__ import annotations

from .event import EventOverlap
from .ops import get_low_latency_ccl_buffer_size


def hint_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """DeepEP's LowLatencyLayout: two copies of (send, recv, signal) buffers, plus its alignment step
    ``(total + 128) // 128 * 128`` (which adds 128 bytes to an already aligned total, as DeepEP does)."""
    n, scales = num_max_dispatch_tokens_per_rank, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(n * dispatch_msg, num_experts * n * combine_msg)
    recv = max(num_experts * n * dispatch_msg, num_experts * n * combine_msg)
    signal = (num_experts * 4 + 127) // 128 * 128
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128


class CompatMixin:
    """Static size hints and DeepEP's no-op helpers."""

    num_sms: int = 20

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of low-latency buffer DeepEP needs for these shapes (its formula; independent of ``num_ranks``)."""
        del num_ranks
        return hint_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @staticmethod
    def get_low_latency_ccl_buffer_size(
        world_size: int,
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_moe_expert: int,
        topk: int,
        num_shared_expert: int = 0,
        num_shared_expert_ranks: int = 0,
        comm_alg: str = "",
    ) -> int:
        """MB of CCL buffer the Ascend ops need (ops-transformer's formula; see
        :func:`deep_ep_npu.ops.get_low_latency_ccl_buffer_size`), e.g. 479 for ``(8, 128, 7168, 256, 8)``."""
        return get_low_latency_ccl_buffer_size(
            world_size,
            num_max_dispatch_tokens_per_rank,
            hidden,
            num_moe_expert,
            topk,
            num_shared_expert,
            num_shared_expert_ranks,
            comm_alg,
        )

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Accepted for compatibility (normal kernels only in DeepEP; nothing to set here)."""
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be even, got {new_num_sms}")
        CompatMixin.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An already-complete event (there is no separate communication stream to capture here)."""
        return EventOverlap(None)

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    def get_comm_stream(self) -> None:
        """There is no separate communication stream; returns None."""
        return None
