"""The typed handles that dispatch returns and combine consumes.

:class:`LowLatencyHandle` is DeepEP's 5-tuple ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
num_experts)`` as a NamedTuple: ``handle[0]`` and ``handle.src_info`` both work, and unpacking into five names works.
A backend may attach private state it needs for combine (``backend_state``); it is not part of the tuple.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

topk_idx_t = torch.int64
"""DeepEP's ``deep_ep.topk_idx_t``: the default ``topk_idx`` dtype (`torch.int32` is accepted as well)."""


class _LowLatencyHandleFields(NamedTuple):
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class LowLatencyHandle(_LowLatencyHandleFields):
    """What ``low_latency_dispatch`` returns for ``low_latency_combine`` (DeepEP's handle, typed).

    Fields (L = num_local_experts, R = num_ranks, N = num_max_dispatch_tokens_per_rank):
        src_info: `[L, R * N]` with `torch.int32`: for each received row, its row index in the source rank's ``x``.
        layout_range: `[L, R]` with `torch.int64`: ``(begin << 32) | count`` of the rows source rank j owns in
            local expert i's block of ``recv_x``.
        num_max_dispatch_tokens_per_rank: N, as given to dispatch.
        hidden: the hidden size of ``x``.
        num_experts: the total number of (routed) experts.

    ``backend_state`` (not a tuple element) holds whatever the backend that produced the handle needs in combine.
    """

    backend_state: Any = None

    @property
    def recv_begin(self) -> torch.Tensor:
        """`[L, R]` `torch.int64`: first row of each source rank's block (``layout_range >> 32``)."""
        return self.layout_range >> 32

    @property
    def recv_count_per_rank(self) -> torch.Tensor:
        """`[L, R]` `torch.int64`: rows of each source rank's block (``layout_range & 0xffffffff``)."""
        return self.layout_range & 0xFFFFFFFF


def make_handle(
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_experts: int,
    backend_state: Any = None,
) -> LowLatencyHandle:
    handle = LowLatencyHandle(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    if backend_state is not None:
        handle.backend_state = backend_state
    return handle


class FlatHandle(NamedTuple):
    """What ``low_latency_dispatch_flat`` returns for ``low_latency_combine_flat`` (the Ascend flat layout).

    Fields (W = num_ranks, L = num_local_experts, A = rows this rank can receive):
        assist_info_for_combine: `[max(T * K, A * 128)]` `torch.int32` (opaque on the NPU; (src rank, src token,
            top-k slot) triples on the reference backend).
        ep_recv_counts: `[W * L]` `torch.int32` inclusive cumsum of rows over (local expert, source rank).
        tp_recv_counts: `[1]` `torch.int32`.
        expand_scales: `[A]` `torch.float32` top-k weight of each row when ``topk_weights`` was given, else `[0]`.
        num_experts: the routed experts (``moe_expert_num``).
        op_kwargs: the layout keywords (special expert counts, global_bs, x_active_mask) combine must repeat.
    """

    assist_info_for_combine: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expand_scales: torch.Tensor
    num_experts: int
    op_kwargs: dict
