"""DeepEP V2's ``EPHandle``: what ``ElasticBuffer.dispatch`` returns, ``combine`` consumes and a cached dispatch
reuses."""

from __future__ import annotations

from typing import Any

import torch


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

    def __init__(
        self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int,
        topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list[int], psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor, state: Any = None,
    ) -> None:  # fmt: skip
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata, self.dst_buffer_slot_idx = recv_src_metadata, dst_buffer_slot_idx
        self.token_metadata_at_forward: torch.Tensor | None = None
        self.channel_linked_list: torch.Tensor | None = None
        self.state = state  # the producing backend's (its placement, send plan, owner); opaque to callers

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
