"""torch_npu's ``npu_moe_update_expert``
(https://github.com/Ascend/op-plugin/blob/2ef21a0/docs/context/torch_npu-npu_moe_update_expert.md): logical top-k ids ->
physical ids through an EPLB table, before ``moe_distribute_dispatch_v2`` with ``moe_expert_num`` = the table's total
replica count."""

from __future__ import annotations

import torch

from ..eplb.routing import update_expert


def moe_update_expert(
    expert_ids: torch.Tensor,
    eplb_table: torch.Tensor,
    *,
    expert_scales: torch.Tensor | None = None,
    pruning_threshold: torch.Tensor | None = None,
    active_mask: torch.Tensor | None = None,
    local_rank_id: int = -1,
    world_size: int = -1,
    balance_mode: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_moe_update_expert``: pick one replica per (token, k) and optionally prune small weights.

    Arguments:
        expert_ids: `[BS, K]` int32/int64, logical expert ids in ``[0, log_expert_num)``.
        eplb_table: `[log_expert_num, F]` int32; column 0 the replica count (1..F-1), columns ``1..count`` the
            replicas' physical ids in ``[0, moe_expert_num)`` (:func:`deep_ep_npu.eplb.eplb_table` builds it).
        expert_scales: `[BS, K]` fp16/bf16/fp32 top-k weights (sorted descending per token), for pruning.
        pruning_threshold: `[K]` or `[1, K]` fp32; pair (i, k) is pruned when
            ``expert_scales[i, k] < pruning_threshold[k] * sum_j expert_scales[i, j]``.
        active_mask: `[BS]` bool (a prefix of True), needs ``expert_scales`` and ``pruning_threshold``; inactive
            tokens get an all-False row.
        local_rank_id, world_size: this rank in the EP group (``balance_mode`` 0 needs both).
        balance_mode: 0 = by rank (``column = local_rank_id // ceil(world_size / count) + 1``), 1 = by token
            (``column = token % count + 1``).

    Returns:
        balanced_expert_ids: `[BS, K]`, ``expert_ids``' dtype, physical ids; balanced_active_mask: `[BS, K]` bool
        (all True without pruning inputs). Bad input raises :class:`~deep_ep_npu.MoeDistributeError` naming the
        parameter.
    """
    return update_expert(
        expert_ids,
        eplb_table,
        expert_scales=expert_scales,
        pruning_threshold=pruning_threshold,
        active_mask=active_mask,
        local_rank_id=local_rank_id,
        world_size=world_size,
        balance_mode=balance_mode,
    )
