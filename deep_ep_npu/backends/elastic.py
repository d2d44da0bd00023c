"""Shrink-mode masks as the Ascend ops' ``elastic_info`` (scaled-down EP), for the ascend backend.

DeepEP's mask keeps every expert's number and treats a masked rank's experts as absent. The ops' ``elastic_info``
(`[4 + 2W]` int32: ``is_scaled_down, new_rank_count W', new_shared_rank_count, new_moe_expert_count E',
Table1[W] (EP rank -> new rank or -1), Table2[W] (new rank -> EP rank, padded with -1)``) instead lays E' experts
over the W' live ranks. With ``E' = W' * L`` every live rank keeps its L local experts, so an expert id maps as
``e -> Table1[e // L] * L + e % L``, and ids on masked ranks become -1 (no expert). Masked ranks still call the ops
and send and receive nothing; ``ep_recv_counts`` stays per EP source rank (0 for masked ones).
"""

from __future__ import annotations

import torch


def elastic_info_from_mask(mask: torch.Tensor, num_local_experts: int) -> torch.Tensor | None:
    """The ``elastic_info`` `[4 + 2R]` `torch.int32` for ``mask`` `[R]` `torch.int32` (1 = masked), or None when no
    rank is masked.

    Raises:
        ValueError: every rank is masked (there is no EP left to scale down to).
    """
    masked = mask.bool().tolist()
    if not any(masked):
        return None
    live = [r for r, m in enumerate(masked) if not m]
    if not live:
        raise ValueError("mask: every rank is masked; at least one rank must stay in the EP group")
    r = len(masked)
    table1 = [live.index(rank) if rank in live else -1 for rank in range(r)]
    table2 = live + [-1] * (r - len(live))
    head = [1, len(live), 0, len(live) * num_local_experts]
    return torch.tensor(head + table1 + table2, dtype=torch.int32)


def remap_expert_ids(topk_idx: torch.Tensor, elastic_info: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """DeepEP expert ids `[T, K]` (-1: none) -> ids over the live ranks (``elastic_info``'s Table1), with -1 for
    experts on masked ranks. Same dtype and device as ``topk_idx``."""
    r = (elastic_info.numel() - 4) // 2
    table1 = elastic_info[4 : 4 + r].to(device=topk_idx.device, dtype=torch.int64)
    ids = topk_idx.long()
    owner = table1[ids.clamp(min=0) // num_local_experts]
    new = owner * num_local_experts + ids.clamp(min=0) % num_local_experts
    return torch.where((ids < 0) | (owner < 0), -1, new).to(topk_idx.dtype)
