"""Expert-parallel load balancing: DeepSeek's placement algorithm (:mod:`.algorithm`), placements and their maps
(:mod:`.placement`) and the logical -> physical id mapping of torch_npu's ``npu_moe_update_expert``
(:mod:`.routing`). The exchange itself runs on physical ids with ``num_experts = P`` (``docs/eplb.md``
balancing")."""

from .algorithm import balanced_packing, rebalance_experts, replicate_experts
from .expert_map import ExpertMap
from .placement import (
    balancedness,
    check_placement,
    default_placement,
    drop_ranks,
    maps,
    placement_json,
    rank_loads,
    read_placement_json,
)
from .routing import BALANCE_BY_RANK, BALANCE_BY_TOKEN, eplb_table, pruned_mask, to_physical, update_expert

__all__ = [
    "BALANCE_BY_RANK", "BALANCE_BY_TOKEN", "ExpertMap", "balanced_packing", "balancedness", "check_placement",
    "default_placement", "drop_ranks", "eplb_table", "maps", "placement_json", "pruned_mask", "rank_loads",
    "read_placement_json", "rebalance_experts", "replicate_experts", "to_physical", "update_expert",
]  # fmt: skip
