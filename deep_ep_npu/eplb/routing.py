"""Logical -> physical expert ids by torch_npu's ``npu_moe_update_expert`` semantics
(https://github.com/Ascend/op-plugin/blob/2ef21a0/docs/context/torch_npu-npu_moe_update_expert.md),
and the EPLB table it reads. One implementation: :func:`update_expert` (torch_npu's signature, also
:func:`deep_ep_npu.ops.moe_update_expert`) and the serving layer both call :func:`to_physical`.
"""

from __future__ import annotations

import torch

from ..errors import invalid, null, shape

BALANCE_BY_RANK, BALANCE_BY_TOKEN = 0, 1


def eplb_table(log2phy: torch.Tensor) -> torch.Tensor:
    """torch_npu's ``eplb_table`` from one layer's ``log2phy`` `[E, X]` int64 (-1 padded): `[E, X + 1]` int32,
    column 0 the replica count, columns ``1..count`` the replicas' physical ids (then zeros)."""
    count = (log2phy >= 0).sum(dim=1, keepdim=True)
    return torch.cat([count, log2phy.clamp(min=0)], dim=1).to(torch.int32)


def _check(
    expert_ids: torch.Tensor, table: torch.Tensor, balance_mode: int, local_rank_id: int, world_size: int
) -> None:
    if expert_ids.dim() != 2 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise invalid(
            "expert_ids", f"must be 2-D (BS, K) int32/int64, got {tuple(expert_ids.shape)} {expert_ids.dtype}"
        )
    if table.dim() != 2 or table.shape[1] < 2 or table.dtype != torch.int32:
        raise invalid(
            "eplb_table", f"must be 2-D (log_expert_num, F >= 2) int32, got {tuple(table.shape)} {table.dtype}"
        )
    if balance_mode not in (BALANCE_BY_RANK, BALANCE_BY_TOKEN):
        raise invalid("balance_mode", f"got {balance_mode}; allowed: 0 (by rank) or 1 (by token)")
    counts = table[:, 0]
    if table.shape[0] and (int(counts.min()) < 1 or int(counts.max()) > table.shape[1] - 1):
        raise invalid("eplb_table", f"column 0 (replica counts) must be in [1, F - 1 = {table.shape[1] - 1}]")
    if balance_mode == BALANCE_BY_RANK and not (world_size >= 1 and 0 <= local_rank_id < world_size):
        raise invalid(
            "local_rank_id",
            f"got {local_rank_id} with world_size {world_size}; balance_mode 0 needs "
            "world_size >= 1 and 0 <= local_rank_id < world_size",
        )
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= table.shape[0]):
        raise shape("expert_ids", f"ids must be in [0, log_expert_num = {table.shape[0]})")


def to_physical(
    expert_ids: torch.Tensor,
    table: torch.Tensor,
    *,
    balance_mode: int = BALANCE_BY_RANK,
    local_rank_id: int = -1,
    world_size: int = -1,
) -> torch.Tensor:
    """Each logical id's replica: ``table[e, column]`` with ``column = local_rank_id // ceil(world_size / count) + 1``
    (balance_mode 0: the ranks cut into ``count`` contiguous blocks) or ``column = token % count + 1`` (balance_mode
    1: token = the row of ``expert_ids``).

    Arguments:
        expert_ids: `[BS, K]` int32/int64 logical ids in ``[0, E)``.
        table: `[E, F]` int32, :func:`eplb_table`'s format.

    Returns:
        `[BS, K]`, ``expert_ids``' dtype, physical ids. Raises :class:`~deep_ep_npu.MoeDistributeError` on bad input.
    """
    _check(expert_ids, table, balance_mode, local_rank_id, world_size)
    ids = expert_ids.long()
    counts = table[:, 0].long().to(ids.device)[ids]
    if balance_mode == BALANCE_BY_RANK:
        column = local_rank_id // torch.div(world_size + counts - 1, counts, rounding_mode="floor") + 1
    else:
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        column = token % counts + 1
    return table.to(ids.device).long()[ids, column].to(expert_ids.dtype)


def pruned_mask(
    expert_scales: torch.Tensor, pruning_threshold: torch.Tensor, active_mask: torch.Tensor | None
) -> torch.Tensor:
    """``mask[i, k] = active[i] and not scale[i, k] < threshold[k] * sum_j scale[i, j]`` (the sum in fp32, j in
    order), for ``expert_scales`` `[BS, K]` fp16/bf16/fp32, ``pruning_threshold`` `[K]` or `[1, K]` fp32,
    ``active_mask`` `[BS]` bool (a prefix of True) or None. Returns `[BS, K]` bool."""
    if expert_scales.dim() != 2 or expert_scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise invalid(
            "expert_scales", f"must be (BS, K) fp16/bf16/fp32, got {tuple(expert_scales.shape)} {expert_scales.dtype}"
        )
    k = expert_scales.shape[1]
    if (
        pruning_threshold.dtype != torch.float32
        or pruning_threshold.reshape(-1).shape[0] != k
        or pruning_threshold.dim() not in (1, 2)
    ):
        raise invalid(
            "pruning_threshold",
            f"must be (K,) or (1, K) fp32 with K = {k}, got {tuple(pruning_threshold.shape)} {pruning_threshold.dtype}",
        )
    scales = expert_scales.float()
    total = torch.zeros(scales.shape[0], dtype=torch.float32, device=scales.device)
    for j in range(k):
        total = total + scales[:, j]
    mask = ~(scales < pruning_threshold.reshape(1, k).to(scales.device) * total.unsqueeze(1))
    if active_mask is not None:
        if active_mask.dtype != torch.bool or active_mask.shape != (scales.shape[0],):
            raise invalid(
                "active_mask",
                f"must be (BS,) = ({scales.shape[0]},) bool, got {tuple(active_mask.shape)} {active_mask.dtype}",
            )
        mask &= active_mask.unsqueeze(1)
    return mask


def update_expert(
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
    if (expert_scales is None) != (pruning_threshold is None):
        missing = "pruning_threshold" if pruning_threshold is None else "expert_scales"
        raise null(missing, "pruning needs both expert_scales and pruning_threshold")
    if active_mask is not None and expert_scales is None:
        raise null("expert_scales", "active_mask needs expert_scales and pruning_threshold")
    ids = to_physical(
        expert_ids, eplb_table, balance_mode=balance_mode, local_rank_id=local_rank_id, world_size=world_size
    )
    if expert_scales is None or pruning_threshold is None:
        return ids, torch.ones(expert_ids.shape, dtype=torch.bool, device=expert_ids.device)
    if expert_scales.shape != expert_ids.shape:
        raise invalid(
            "expert_scales", f"must have expert_ids' shape {tuple(expert_ids.shape)}, got {tuple(expert_scales.shape)}"
        )
    return ids, pruned_mask(expert_scales, pruning_threshold, active_mask)
