"""The stand-in's ``torch.ops.cann_ops_transformer.npu_mega_moe`` (CANN's op schema:
https://gitcode.com/cann/ops-transformer ``torch_extension``): the op that
``cann_ops_transformer.mega_moe`` wraps, mapped back onto :func:`deep_ep_npu.cann.mega_moe` (the context names the
group; the op's sizes and modes fill the :class:`~deep_ep_npu.cann.SymmBuffer` the wrapper would have read them
from). And the old package's ``MoeDistributeBuffer``, whose context has the old layout (`[2052]` int32)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import cann
from ..errors import shape
from ..ops.context import context_group

SCHEMA = (
    "npu_mega_moe(Tensor context, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] weight1, "
    "Tensor[] weight2, int moe_expert_num, int ep_world_size, int ccl_buffer_size, *, "
    "Tensor[]? weight_scales1=None, Tensor[]? weight_scales2=None, Tensor[]? bias1=None, Tensor[]? bias2=None, "
    "Tensor? x_active_mask=None, Tensor[]? shared_weight1=None, Tensor[]? shared_weight2=None, "
    "Tensor[]? shared_weight_scales1=None, Tensor[]? shared_weight_scales2=None, Tensor[]? shared_bias1=None, "
    "Tensor[]? shared_bias2=None, int max_recv_token_num=0, int dispatch_quant_mode=0, int combine_quant_mode=0, "
    "str comm_alg='', int num_max_tokens_per_rank=0, str activation='swiglu', float? activation_clamp=None, "
    "int? dispatch_quant_out_dtype=None, int? weight1_type=None, int? weight2_type=None, int? topo_type=None, "
    "int? rank_num_per_server=None) -> (Tensor, Tensor)"
)


class OldMoeDistributeBuffer(cann.MoeDistributeBuffer):
    """``npu_ops_transformer.ops.MoeDistributeBuffer``: its context is the old layout, `[2052]` `torch.int32`."""

    context_layout = "old"


def _stacked(tensors: list[torch.Tensor] | None) -> torch.Tensor | None:
    return None if tensors is None else torch.stack(list(tensors))


def npu_mega_moe(
    context: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight1: list[torch.Tensor],
    weight2: list[torch.Tensor],
    moe_expert_num: int,
    ep_world_size: int,
    ccl_buffer_size: int,
    *,
    weight_scales1: list[torch.Tensor] | None = None,
    weight_scales2: list[torch.Tensor] | None = None,
    bias1: list[torch.Tensor] | None = None,
    bias2: list[torch.Tensor] | None = None,
    x_active_mask: torch.Tensor | None = None,
    shared_weight1: list[torch.Tensor] | None = None,
    shared_weight2: list[torch.Tensor] | None = None,
    shared_weight_scales1: list[torch.Tensor] | None = None,
    shared_weight_scales2: list[torch.Tensor] | None = None,
    shared_bias1: list[torch.Tensor] | None = None,
    shared_bias2: list[torch.Tensor] | None = None,
    max_recv_token_num: int = 0,
    dispatch_quant_mode: int = 0,
    combine_quant_mode: int = 0,
    comm_alg: str = "",
    num_max_tokens_per_rank: int = 0,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    dispatch_quant_out_dtype: int | None = None,
    weight1_type: int | None = None,
    weight2_type: int | None = None,
    topo_type: int | None = None,
    rank_num_per_server: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [BS, H] in x's dtype, expert_token_nums [E / W] int32)``: ``cann.mega_moe`` on the context's group
    (``num_max_tokens_per_rank`` 0: x's rows, which must then be the same on every rank)."""
    group, ccl = context_group(context)
    if ep_world_size != dist.get_world_size(group):
        raise shape("ep_world_size", f"is {ep_world_size} but the context's group has {dist.get_world_size(group)}")
    n = num_max_tokens_per_rank or x.shape[0]
    sym = cann.SymmBuffer(
        group,
        dist.get_rank(group),
        group.group_name,
        ep_world_size,
        context,
        ccl,
        moe_expert_num,
        max_recv_token_num,
        n,
        topk_ids.shape[1],
        x.shape[1],
        0,
        dispatch_quant_mode,
        dispatch_quant_out_dtype,
        combine_quant_mode,
        comm_alg,
        topo_type or 0,
        rank_num_per_server or 2,
    )
    return cann.mega_moe(
        x,
        topk_ids,
        topk_weights,
        list(weight1),
        list(weight2),
        sym,
        l1_weights_sf=weight_scales1,
        l2_weights_sf=weight_scales2,
        l1_bias=bias1,
        l2_bias=bias2,
        x_active_mask=x_active_mask,
        activation=activation,
        activation_clamp=activation_clamp,
        weight1_type=weight1_type,
        weight2_type=weight2_type,
        shared_l1_weights=_stacked(shared_weight1),
        shared_l2_weights=_stacked(shared_weight2),
        shared_l1_weights_sf=shared_weight_scales1,
        shared_l2_weights_sf=shared_weight_scales2,
        shared_l1_bias=shared_bias1,
        shared_l2_bias=shared_bias2,
    )
