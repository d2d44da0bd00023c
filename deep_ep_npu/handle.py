"""The typed handles that dispatch returns and combine consumes."""

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
    """DeepEP's 5-tuple handle (``low_latency_dispatch`` -> ``low_latency_combine``) as a NamedTuple; with L local
    experts, R ranks, N = num_max_dispatch_tokens_per_rank: ``src_info`` `[L, R * N]` `torch.int32` (each received
    row's row index in the source rank's ``x``), ``layout_range`` `[L, R]` `torch.int64` (``(begin << 32) | count``
    of source rank j's rows in local expert i's block of ``recv_x``), N, ``hidden`` (x's) and ``num_experts`` (total
    routed). ``backend_state`` (not a tuple element): private state the producing backend needs in combine."""

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
    src_info: torch.Tensor, layout_range: torch.Tensor, num_max_dispatch_tokens_per_rank: int, hidden: int,
    num_experts: int, backend_state: Any = None,
) -> LowLatencyHandle:  # fmt: skip
    handle = LowLatencyHandle(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    handle.backend_state = backend_state
    return handle


class FlatHandle(NamedTuple):
    """``low_latency_dispatch_flat``'s handle for ``low_latency_combine_flat`` (W ranks, L local experts, A = rows this
    rank can receive): ``assist_info_for_combine`` `[max(T * K, A * 128)]` `torch.int32` (opaque on the NPU; (src
    rank, src token, top-k slot) triples on the reference backend); ``ep_recv_counts`` `[W * L]` `torch.int32`
    inclusive cumsum of rows over (local expert, source rank); ``tp_recv_counts`` `[1]` `torch.int32`;
    ``expand_scales`` `[A]` `torch.float32` top-k weight of each row when ``topk_weights`` was given, else `[0]`;
    ``num_experts``, the routed experts (``moe_expert_num``); ``op_kwargs``, the layout keywords (special expert
    counts, global_bs, x_active_mask) combine repeats."""

    assist_info_for_combine: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expand_scales: torch.Tensor
    num_experts: int
    op_kwargs: dict
