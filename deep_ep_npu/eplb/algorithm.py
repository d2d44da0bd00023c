"""DeepSeek's expert-parallel load balancer (EPLB), reimplemented from its description
(https://github.com/deepseek-ai/EPLB):
replicate the hottest experts onto redundant slots and pack the slots onto ranks so that every rank gets about the
same load. Pure CPU tensor code, no communication; every rank computes the same result from the same ``weight``.

Two policies: *hierarchical* (expert groups packed onto nodes, replication within each node, replicas packed onto
the node's ranks) when ``num_groups % num_nodes == 0``, else *global* (the same routine with one group and one node).
"""

from __future__ import annotations

import torch

from ..errors import invalid


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each, per row: items by
    weight descending (ties: lower index first), each into the lightest pack with room (ties: the lowest pack).

    Arguments:
        weight: `[X, n]` float, ``n % num_packs == 0``.

    Returns:
        pack_index: `[X, n]` int64, each item's pack; rank_in_pack: `[X, n]` int64, the order it entered its pack.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        ident = torch.arange(n, dtype=torch.int64).expand(rows, n).clone()
        return ident, torch.zeros_like(ident)
    order = weight.float().sort(dim=-1, descending=True, stable=True).indices.tolist()
    values = weight.float().tolist()
    pack_index = torch.full((rows, n), -1, dtype=torch.int64)
    rank_in_pack = torch.full((rows, n), -1, dtype=torch.int64)
    for i in range(rows):
        loads, items = [0.0] * num_packs, [0] * num_packs
        for item in order[i]:
            pack = min((p for p in range(num_packs) if items[p] < per_pack), key=loads.__getitem__)
            pack_index[i, item], rank_in_pack[i, item] = pack, items[pack]
            loads[pack] += values[i][item]
            items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_phy - num_log`` extra slots, one at a time, to the expert with the highest load per replica.

    Arguments:
        weight: `[X, num_log]` float.

    Returns:
        phy2log: `[X, num_phy]` int64 (slots ``0..num_log-1`` are the identity); rank: `[X, num_phy]` int64, each
        slot's replica ordinal; logcnt: `[X, num_log]` int64, the replica counts.
    """
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    row = torch.arange(rows)
    for slot in range(num_log, num_phy):
        hot = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = hot
        rank[:, slot] = logcnt[row, hot]
        logcnt[row, hot] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation `[X, n]` int64."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hierarchical policy on ``weight`` `[layers, E]` float: returns phy2log `[layers, P]`, each slot's replica
    ordinal `[layers, P]` and logcnt `[layers, E]` (all int64). Slot ``p`` lives on rank ``p // (P / num_gpus)``."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus
    # 1. groups -> nodes; "mlog" order: node-major, each group's experts contiguous
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
        + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node
    mlog_load = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_physical // num_nodes)
    # 3. the node's replicas -> its GPUs (within a GPU: heavier first)
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in_pack = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank_in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_base = torch.arange(0, num_logical, num_logical // num_nodes, dtype=torch.int64).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_base).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's EPLB: where to put ``num_replicas`` physical expert slots so that ``num_ranks`` ranks get equal load.

    Arguments:
        weight: `[layers, E]` any numeric dtype, any device: each logical expert's load (e.g. tokens over a window).
        num_replicas: P >= E, the physical slots per layer, a multiple of ``num_ranks``.
        num_groups: expert groups (group-limited routing), dividing E; num_nodes: nodes, dividing ``num_ranks``.
        num_ranks: ranks (GPUs / NPUs); slot ``p`` lives on rank ``p // (P / num_ranks)``.

    Returns:
        phy2log: `[layers, P]` int64, the logical expert of each slot; log2phy: `[layers, E, X]` int64, each logical
        expert's slots in replica order, padded with -1 (X = the largest replica count); logcnt: `[layers, E]` int64,
        the replica counts (>= 1). All on the CPU.
    """
    if weight.dim() != 2:
        raise invalid("weight", f"must be 2-D [layers, num_logical_experts], got shape {tuple(weight.shape)}")
    layers, num_logical = weight.shape
    checks = (
        ("num_ranks", num_ranks, num_ranks >= 1 and num_ranks % max(num_nodes, 1) == 0, "a multiple of num_nodes"),
        (
            "num_replicas",
            num_replicas,
            num_replicas >= num_logical and num_replicas % num_ranks == 0,
            f">= num_logical_experts ({num_logical}) and a multiple of num_ranks ({num_ranks})",
        ),
        (
            "num_groups",
            num_groups,
            num_groups >= 1 and num_logical % num_groups == 0,
            f">= 1 and divide num_logical_experts ({num_logical})",
        ),
        ("num_nodes", num_nodes, num_nodes >= 1, ">= 1"),
    )
    for name, value, ok, allowed in checks:
        if not ok:
            raise invalid(name, f"got {value}; must be {allowed}")
    w = weight.detach().float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(w, num_replicas, num_groups, num_nodes, num_ranks)
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(w, num_replicas, 1, 1, num_ranks)
    width = int(logcnt.max())
    log2phy = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(layers, -1)
    log2phy.view(layers, -1).scatter_(-1, phy2log * width + phyrank, slots)
    return phy2log, log2phy, logcnt
