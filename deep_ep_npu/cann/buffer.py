"""CANN ops-transformer's ``MoeDistributeBuffer`` (``cann_ops_transformer.ops`` / ``npu_ops_transformer.ops``): a
communication context (:mod:`deep_ep_npu.ops.context`) for one EP group and low-latency dispatch / combine over the V3
context ops (:func:`~deep_ep_npu.ops.moe_distribute_dispatch_v3` / ``combine_v3``), which it maps its arguments onto
(https://github.com/cannmirror/ops-transformer/blob/25fb6b9/torch_extension/cann_ops_transformer/ops/deep_ep.py). Errors
name this front-end's parameters (``topk_idx``, ``num_experts``, ...)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import MoeDistributeError, shape
from ..ops.context import context_group, create_context
from ..ops.v3 import moe_distribute_combine_v3, moe_distribute_dispatch_v3
from ..sizes import get_low_latency_ccl_buffer_size

DISPATCH_NAMES = {"expert_ids": "topk_idx", "moe_expert_num": "num_experts", "scales": "x_smooth_scale",
                  "expert_scales": "topk_weights", "global_bs": "num_max_dispatch_tokens_per_rank",
                  "scales_dtype": "x_smooth_scales_dtype"}  # fmt: skip
COMBINE_NAMES = {"expand_x": "x", "expert_ids": "topk_idx", "moe_expert_num": "num_experts",
                 "expert_scales": "topk_weights", "expert_shard_type": "expert_shared_type",
                 "global_bs": "num_max_dispatch_tokens_per_rank"}  # fmt: skip


class MoeDistributeBuffer:
    """``MoeDistributeBuffer(group, ccl_buffer_size=0, comm_alg=0)``: the context of this rank of ``group`` (every
    rank constructs one). ``ccl_buffer_size`` and ``comm_alg`` are accepted and ignored, as in CANN; the attribute
    ``ccl_buffer_size`` is the communicator's CCL buffer in bytes (twice ``HCCL_BUFFSIZE`` MB, default 200), which
    the ops get. Attributes ``group``, ``rank_id``, ``world_size``, ``group_name``, ``context`` (`[4100]`
    `torch.int32`). Methods ``low_latency_dispatch`` / ``low_latency_combine`` (``cann_ops_transformer``), also as
    ``npu_low_latency_dispatch`` / ``npu_low_latency_combine`` (``npu_ops_transformer``)."""

    get_low_latency_ccl_buffer_size = staticmethod(get_low_latency_ccl_buffer_size)
    context_layout = "new"  # (the old package's: "old", `[2052]`)

    def __init__(self, group: dist.ProcessGroup, ccl_buffer_size: int = 0, comm_alg: int = 0) -> None:
        self.context = create_context(group, self.context_layout)
        self._bind(group)

    def _bind(self, group: dist.ProcessGroup) -> None:
        self.group, self.rank_id, self.world_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.group_name = group.group_name
        self.ccl_buffer_size = context_group(self.context)[1]

    def update_ctx(self, new_group: dist.ProcessGroup) -> bool:
        """Rebuild the context in place (the same tensor, so captured graphs keep it) for ``new_group``, which must
        have the same world size; refreshes the rank, name and ``ccl_buffer_size``. Returns True."""
        if dist.get_world_size(new_group) != self.world_size:
            why = f"has {dist.get_world_size(new_group)} ranks; the world size must stay {self.world_size}"
            raise shape("new_group", why)
        create_context(new_group, self.context_layout, out=self.context)
        self._bind(new_group)
        return True

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_experts: int,
        *,
        quant_mode: int = 0,
        comm_alg: str = "",
        x_smooth_scale: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        zero_expert_num: int = 0,
        copy_expert_num: int = 0,
        const_expert_num: int = 0,
        elastic_info: torch.Tensor | None = None,
        expert_shard_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        expert_token_nums_type: int = 1,
        num_max_dispatch_tokens_per_rank: int = 0,
        y_dtype: Any = None,
        x_dtype: Any = None,
        x_smooth_scales_dtype: Any = None,
    ) -> tuple[torch.Tensor, ...]:
        """Dispatch: :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v3` with ``x`` `[Bs, H]`, ``topk_idx``
        `[Bs, K]` `torch.int32` (the op's ``expert_ids``), ``x_smooth_scale`` (``scales``), ``topk_weights``
        `[Bs, K]` `torch.float32` (``expert_scales``; None: ``expand_scales`` is empty), ``global_bs =
        num_max_dispatch_tokens_per_rank * W`` (0: every rank has the same Bs) and no TP. Returns
        ``(expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, expand_scales)``
        (the op's outputs without ``tp_recv_counts``)."""
        w, r, ccl = self.world_size, self.rank_id, self.ccl_buffer_size
        try:
            out = moe_distribute_dispatch_v3(
                self.context,
                x,
                topk_idx,
                w,
                r,
                num_experts,
                ccl,
                scales=x_smooth_scale,
                x_active_mask=x_active_mask,
                expert_scales=topk_weights,
                elastic_info=elastic_info,
                expert_shard_type=expert_shard_type,
                shared_expert_num=shared_expert_num,
                shared_expert_rank_num=shared_expert_rank_num,
                quant_mode=quant_mode,
                global_bs=num_max_dispatch_tokens_per_rank * w,
                expert_token_nums_type=expert_token_nums_type,
                comm_alg=comm_alg,
                zero_expert_num=zero_expert_num,
                copy_expert_num=copy_expert_num,
                const_expert_num=const_expert_num,
                y_dtype=y_dtype,
                x_dtype=x_dtype,
                scales_dtype=x_smooth_scales_dtype,
            )
        except MoeDistributeError as err:
            raise err.renamed(DISPATCH_NAMES) from None
        return (*out[:5], out[6])

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        assist_info_for_combine: torch.Tensor,
        ep_send_counts: torch.Tensor,
        *,
        num_experts: int = 0,
        comm_alg: str = "",
        comm_quant_mode: int = 0,
        x_active_mask: torch.Tensor | None = None,
        expand_scales: torch.Tensor | None = None,
        shared_expert_x: torch.Tensor | None = None,
        elastic_info: torch.Tensor | None = None,
        ori_x: torch.Tensor | None = None,
        const_expert_alpha_1: torch.Tensor | None = None,
        const_expert_alpha_2: torch.Tensor | None = None,
        const_expert_v: torch.Tensor | None = None,
        zero_expert_num: int = 0,
        copy_expert_num: int = 0,
        const_expert_num: int = 0,
        expert_shared_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        num_max_dispatch_tokens_per_rank: int = 0,
    ) -> torch.Tensor:
        """Combine: :func:`~deep_ep_npu.ops.moe_distribute_combine_v3` with ``x`` the expert outputs `[A, H]`
        (``expand_x``), ``topk_weights`` `[Bs, K]` `torch.float32` (None: an empty tensor, a plain sum),
        ``expert_shared_type`` (``expert_shard_type``) and ``global_bs = num_max_dispatch_tokens_per_rank * W``.
        Returns `[Bs, H]` in x's dtype."""
        weights = torch.empty((0,), dtype=torch.float32, device=x.device) if topk_weights is None else topk_weights
        w, r, ccl = self.world_size, self.rank_id, self.ccl_buffer_size
        try:
            return moe_distribute_combine_v3(
                self.context,
                x,
                topk_idx,
                assist_info_for_combine,
                ep_send_counts,
                weights,
                w,
                r,
                num_experts,
                ccl,
                x_active_mask=x_active_mask,
                expand_scales=expand_scales,
                shared_expert_x=shared_expert_x,
                elastic_info=elastic_info,
                ori_x=ori_x,
                const_expert_alpha_1=const_expert_alpha_1,
                const_expert_alpha_2=const_expert_alpha_2,
                const_expert_v=const_expert_v,
                expert_shard_type=expert_shared_type,
                shared_expert_num=shared_expert_num,
                shared_expert_rank_num=shared_expert_rank_num,
                global_bs=num_max_dispatch_tokens_per_rank * w,
                comm_quant_mode=comm_quant_mode,
                comm_alg=comm_alg,
                zero_expert_num=zero_expert_num,
                copy_expert_num=copy_expert_num,
                const_expert_num=const_expert_num,
            )
        except MoeDistributeError as err:
            raise err.renamed(COMBINE_NAMES) from None

    npu_low_latency_dispatch = low_latency_dispatch
    npu_low_latency_combine = low_latency_combine
