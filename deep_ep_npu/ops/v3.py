"""CANN ops-transformer's V3 context ops (``npu_moe_distribute_dispatch_v3`` / ``combine_v3``, renamed
``npu_moe_distribute_dispatch`` / ``combine`` in ``cann_ops_transformer``): the ``_v2`` ops with a communication
``context`` (:mod:`.context`) in place of the group names and a ``ccl_buffer_size`` attribute (bytes) checked against
what the shapes need. Everything else (arguments, outputs, numerics, errors) is :func:`moe_distribute_dispatch_v2` /
:func:`moe_distribute_combine_v2`'s (see there); what the context form changes:

- ``context`` must be a context of this process (else MoeDistributeError naming ``context``, raised on this rank
  only: the group is unknown), built for this rank of that communicator (``ep_rank_id`` / ``ep_world_size`` must
  match it; refused on every rank of it).
- ``ccl_buffer_size``: bytes, at most the context's CCL buffer, at least
  ``2 * (maxBs * tokDisp * W * L + maxBs * tokComb * (K + S)) + 1 MB`` (the error names the bytes needed).
- There is no TP communicator in a context: ``tp_world_size`` must be 0 or 1 (TP is reserved in the context docs);
  ``comm_alg="hierarchy"`` is refused, as the tiling does in context mode.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import ascend, rules
from ..engine.exchange import engine_for
from ..errors import invalid
from .context import check_ccl, check_context, context_group
from .v2 import moe_distribute_combine_v2, moe_distribute_dispatch_v2

DISPATCH_V3, COMBINE_V3 = "moe_distribute_dispatch_v3", "moe_distribute_combine_v3"


def _group(
    op: str,
    context: Any,
    sizes: tuple[Any, ...],
    x: Any,
    ids: Any,
    tp_world_size: Any,
    global_bs: Any,
    layout: dict[str, Any],
) -> Any:
    """The group ``context`` names, after the context-form checks (told to its peers when one fails). ``layout``: the
    op's ``expert_shard_type``, ``shared_expert_num``, ``shared_expert_rank_num`` and ``comm_alg``."""
    group, have = context_group(context)
    engine, (ep_world_size, ep_rank_id, moe_expert_num, ccl_buffer_size) = engine_for(group), sizes
    with engine.rejecting(op):
        check_context(context, group, ep_world_size, ep_rank_id)
        if tp_world_size not in (0, 1):
            why = "the context names no TP communicator (TP is reserved in the context ops); pass 0 or 1"
            raise invalid("tp_world_size", f"got {tp_world_size!r}: {why}")
        if layout["comm_alg"] == "hierarchy":
            raise invalid("comm_alg", "'hierarchy' does not support the mc2 context mode; use '', fullmesh_v1 / v2")
        e = ascend.experts(group, ep_world_size, ep_rank_id, moe_expert_num, **layout)
        if all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (x, ids)):
            max_bs = rules.global_bs(global_bs, e.world_size, ids.shape[0], ascend.MAX_BS) // e.world_size
            check_ccl(
                ccl_buffer_size,
                have,
                e.world_size,
                max_bs,
                x.shape[1],
                e.num_local,
                ids.shape[1],
                e.shared_expert_num,
                str(layout["comm_alg"]),
            )
    return group


def moe_distribute_dispatch_v3(
    context: torch.Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    ccl_buffer_size: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    y_dtype: torch.dtype | int | None = None,
    x_dtype: torch.dtype | int | None = None,
    scales_dtype: torch.dtype | int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``npu_moe_distribute_dispatch_v3``: :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2` on the communicator
    ``context`` (`[2052]` / `[4100]` `torch.int32`, :func:`~deep_ep_npu.ops.create_context`) names, with
    ``ccl_buffer_size`` in bytes (see the module docstring). Returns its 7 outputs
    ``(expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales)``."""
    sizes = (ep_world_size, ep_rank_id, moe_expert_num, ccl_buffer_size)
    layout: dict[str, Any] = dict(
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        comm_alg=comm_alg,
    )
    group = _group(DISPATCH_V3, context, sizes, x, expert_ids, tp_world_size, global_bs, layout)
    return moe_distribute_dispatch_v2(
        x,
        expert_ids,
        group,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        scales=scales,
        x_active_mask=x_active_mask,
        expert_scales=expert_scales,
        elastic_info=elastic_info,
        performance_info=performance_info,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        quant_mode=quant_mode,
        global_bs=global_bs,
        expert_token_nums_type=expert_token_nums_type,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        y_dtype=y_dtype,
        x_dtype=x_dtype,
        scales_dtype=scales_dtype,
        **layout,
    )


def moe_distribute_combine_v3(
    context: torch.Tensor,
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    ccl_buffer_size: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    ori_x: torch.Tensor | None = None,
    const_expert_alpha_1: torch.Tensor | None = None,
    const_expert_alpha_2: torch.Tensor | None = None,
    const_expert_v: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> torch.Tensor:
    """``npu_moe_distribute_combine_v3``: :func:`~deep_ep_npu.ops.moe_distribute_combine_v2` on the communicator
    ``context`` names, ``ccl_buffer_size`` in bytes (module docstring). ``expert_scales`` `[Bs, K]` `torch.float32`,
    or an empty tensor for a plain sum. Returns x `[Bs, H]` in expand_x's dtype."""
    sizes = (ep_world_size, ep_rank_id, moe_expert_num, ccl_buffer_size)
    layout: dict[str, Any] = dict(
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        comm_alg=comm_alg,
    )
    group = _group(COMBINE_V3, context, sizes, expand_x, expert_ids, tp_world_size, global_bs, layout)
    return moe_distribute_combine_v2(
        expand_x,
        expert_ids,
        assist_info_for_combine,
        ep_send_counts,
        expert_scales,
        group,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask,
        expand_scales=expand_scales,
        shared_expert_x=shared_expert_x,
        elastic_info=elastic_info,
        ori_x=ori_x,
        const_expert_alpha_1=const_expert_alpha_1,
        const_expert_alpha_2=const_expert_alpha_2,
        const_expert_v=const_expert_v,
        performance_info=performance_info,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        global_bs=global_bs,
        comm_quant_mode=comm_quant_mode,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        **layout,
    )
