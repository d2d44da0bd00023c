"""The typed handles that dispatch returns and combine consumes (they still unpack as DeepEP's tuples where DeepEP's
are tuples), and DeepEP's ``EventHandle``."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

topk_idx_t = torch.int64  # DeepEP's deep_ep.topk_idx_t: the default topk_idx dtype (torch.int32 is accepted too)


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


@dataclasses.dataclass(repr=False, eq=False)
class EPHandle:
    """The layout of one ``ElasticBuffer.dispatch`` (DeepEP V2's field names). R ranks, L local experts, K top-k,
    T tokens of this rank, num_recv tokens received (the worst case ``R * N`` without CPU sync).

    Attributes:
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: `[T, K]` the dispatch's ids (a clone with ``do_handle_copy``).
        num_recv_tokens, num_expanded_tokens: the rows allocated for ``recv_x`` (exact with CPU sync, else the worst
            case; ``num_expanded_tokens`` counts expand rows, 0 when ``do_expand`` is False).
        num_recv_tokens_per_expert_list: per local expert, its rows aligned to ``expert_alignment`` (a CPU list;
            ``[]`` without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: `[R]` `torch.int32`, inclusive prefix sum of the tokens received
            from each source rank (every rank is one scale-up rank here; the last element is the real total).
        psum_num_recv_tokens_per_expert: `[L]` `torch.int32`: non-expand, the inclusive prefix sum of the aligned
            counts; expand, expert i's aligned start plus its real count.
        num_unaligned_recv_tokens_per_expert: `[L]` `torch.int32`, the real (unaligned) counts.
        recv_src_metadata: `[num_recv, K + 2]` `torch.int32`: column 0 ``src_rank * N + src_token``, column 1 the
            source rank, columns 2+ (expand) the ``recv_x`` row of slot j, or -1 (also on tail rows).
        dst_buffer_slot_idx: `[T, K]` `torch.int32`: the row of slot j's token among the rows this rank sends to
            that expert's rank (-1 for ``topk_idx == -1``).
        token_metadata_at_forward, channel_linked_list: None (DeepEP's hybrid mode only).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    state: Any = None  # the producing backend's (its placement, send plan, owner); opaque to callers
    token_metadata_at_forward: torch.Tensor | None = None
    channel_linked_list: torch.Tensor | None = None

    @property
    def num_topk(self) -> int:
        return int(self.topk_idx.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])

    def __repr__(self) -> str:
        fields = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_recv_tokens")
        shown = ", ".join(f"{name}={getattr(self, name)}" for name in fields)
        return f"EPHandle({shown}, num_tokens={self.num_tokens}, num_topk={self.num_topk})"


class EventHandle:
    """DeepEP's ``EventHandle`` (``ElasticBuffer.capture()`` returns it, ``previous_event`` takes it): always complete,
    since this library's work runs in call order on the calling thread (no separate communication stream)."""

    def current_stream_wait(self) -> None:
        """Returns at once (nothing to wait for)."""

    wait = current_stream_wait  # what an EventOverlap holding it calls


@dataclasses.dataclass(eq=False, repr=False)
class EventOverlap:
    """DeepEP's completion object for ``async_finish=True`` (``InFlight.overlap`` makes it). ``event``: anything
    with ``wait()`` (an :class:`~deep_ep_npu.backends.InFlight` receive, or a ``torch.cuda.Event`` /
    ``torch.npu.Event``), or None for a finished operation; ``extra_tensors``: kept alive until the wait (DeepEP's
    CUDA-graph-safe ``record_stream``)."""

    event: Any = None
    extra_tensors: tuple | None = None

    def current_stream_wait(self) -> None:
        """Block (CPU) or make the current stream wait (device) until the operation is complete. Idempotent."""
        if self.event is not None:
            self.event.wait()
        self.extra_tensors = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        self.current_stream_wait()
