"""The serving layer's expert placement (``docs/eplb.md``): ``num_redundant_experts`` R extra slots
(vLLM's initial placement: slot ``E + i`` holds expert ``i % E``) or a static placement file in vllm-ascend's JSON
format (``expert_placement``; given with R, the two must agree), as a :class:`deep_ep_npu.eplb.ExpertMap` over the
model's MoE layers. Checked where the model config is known (every worker, before its weights load)."""

from __future__ import annotations

from typing import Any

from deep_ep_npu.eplb import ExpertMap, default_placement, read_placement_json
from server.models.config import ModelConfig


def uses_placement(args: Any) -> bool:
    """Whether ``args`` (an :class:`~server.runtime.engine_config.EngineConfig`) asks for a placement map."""
    return bool(args.num_redundant_experts or args.expert_placement or args.eplb)


def build_expert_map(args: Any, cfg: ModelConfig, num_ranks: int) -> ExpertMap | None:
    """The placement ``args`` asks for on ``cfg``'s MoE layers over ``num_ranks`` ranks, or None (contiguous
    blocks, no redundancy). Raises ValueError naming the option and what is wrong."""
    if not uses_placement(args):
        return None
    e, r, layers = cfg.num_experts, args.num_redundant_experts, len(cfg.moe_layers)
    where = f"expert_placement={args.expert_placement}"
    if cfg.fused_experts:
        raise ValueError(
            f"num_redundant_experts / expert_placement / eplb: {cfg.architecture}'s checkpoint stores "
            "every expert of a layer in one tensor, which placements do not read yet"
        )
    if args.expert_placement is None:
        if (e + r) % num_ranks:
            raise ValueError(
                f"num_redundant_experts={r}: num_experts + R = {e} + {r} must be a multiple of the EP "
                f"size {num_ranks} (each rank holds (E + R) / EP slots)"
            )
        phy2log = default_placement(e, r, layers)
    else:
        phy2log = read_placement_json(args.expert_placement, num_ranks)
        if phy2log.shape[0] != layers:
            raise ValueError(f"{where}: places {phy2log.shape[0]} MoE layers; the model has {layers}")
    try:
        expert_map = ExpertMap(phy2log, e, num_ranks)
    except ValueError as err:
        raise ValueError(f"expert placement: {err}") from None
    if r and expert_map.num_physical - e != r:
        raise ValueError(
            f"{where} places {expert_map.num_physical} experts per layer = {e} + "
            f"{expert_map.num_physical - e} redundant, but num_redundant_experts={r}; make them agree "
            "(or give only one)"
        )
    return expert_map
