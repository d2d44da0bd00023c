"""Placements: which logical expert each physical slot holds (``phy2log``), the maps derived from it, the load each
rank gets, and vllm-ascend's JSON form of a static placement (its ``eplb_utils.py``,
https://github.com/vllm-project/vllm-ascend/blob/182b75e/vllm_ascend/eplb/core/eplb_utils.py).

Slot ``p`` of a layer with P slots over R ranks lives on rank ``p // (P / R)``, local slot ``p % (P / R)``; the
exchange runs on slot ids with ``num_experts = P``. A slot of -1 holds nothing (a lost rank's slots).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import invalid


def default_placement(num_logical: int, num_redundant: int, num_layers: int = 1) -> torch.Tensor:
    """vLLM's initial placement: slots ``0..E-1`` hold experts ``0..E-1``, redundant slot ``E + i`` holds ``i % E``.
    Returns phy2log `[num_layers, E + R]` int64."""
    slots = torch.arange(num_logical + num_redundant, dtype=torch.int64) % num_logical
    return slots.repeat(num_layers, 1)


def maps(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From phy2log `[layers, P]` int64 (-1: an empty slot): log2phy `[layers, E, X]` int64, each expert's slots in
    ascending order, -1 padded (X = the largest replica count, >= 1), and logcnt `[layers, E]` int64 (0: no replica)."""
    layers, _ = phy2log.shape
    lists: list[list[list[int]]] = [[[] for _ in range(num_logical)] for _ in range(layers)]
    for layer, row in enumerate(phy2log.tolist()):
        for slot, e in enumerate(row):
            if e >= 0:
                lists[layer][e].append(slot)
    width = max([1] + [len(s) for row in lists for s in row])
    log2phy = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    logcnt = torch.zeros(layers, num_logical, dtype=torch.int64)
    for layer in range(layers):
        for e, slots in enumerate(lists[layer]):
            log2phy[layer, e, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
            logcnt[layer, e] = len(slots)
    return log2phy, logcnt


def check_placement(phy2log: torch.Tensor, num_logical: int, num_ranks: int, what: str = "phy2log") -> None:
    """Raise :class:`~deep_ep_npu.MoeDistributeError` unless ``phy2log`` `[layers, P]` has P a multiple of
    ``num_ranks``, ids in ``[0, E)`` and every expert at least once per layer."""
    if phy2log.dim() != 2 or phy2log.shape[1] % num_ranks or phy2log.shape[1] < num_logical:
        raise invalid(
            what,
            f"shape {tuple(phy2log.shape)}: must be [layers, P] with P >= {num_logical} experts and "
            f"a multiple of {num_ranks} ranks",
        )
    if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical):
        raise invalid(what, f"expert ids must be in [0, {num_logical})")
    for layer, row in enumerate(phy2log.tolist()):
        missing = sorted(set(range(num_logical)) - set(row))
        if missing:
            raise invalid(what, f"layer {layer} places no replica of experts {missing}")


def drop_ranks(phy2log: torch.Tensor, dead: set[int], num_ranks: int) -> tuple[torch.Tensor, list[list[int]]]:
    """``phy2log`` `[layers, P]` with the slots of the ``dead`` ranks emptied (-1), and per layer the logical experts
    left with no replica (the ones a lost rank takes with it)."""
    per_rank = phy2log.shape[1] // num_ranks
    out = phy2log.clone()
    for r in dead:
        out[:, r * per_rank : (r + 1) * per_rank] = -1
    pairs = zip(phy2log.tolist(), out.tolist(), strict=True)
    lost = [sorted({e for e in before if e >= 0} - set(after)) for before, after in pairs]
    return out, lost


def rank_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Each rank's load `[layers, num_ranks]` float64 when logical expert ``e``'s load ``weight[:, e]`` (`[layers,
    E]`) splits evenly over its replicas."""
    _, logcnt = maps(phy2log, weight.shape[1])
    per_replica = weight.double() / logcnt.clamp(min=1)
    slot_load = torch.where(phy2log >= 0, per_replica.gather(1, phy2log.clamp(min=0)), 0.0)
    return slot_load.view(phy2log.shape[0], num_ranks, -1).sum(-1)


def balancedness(loads: torch.Tensor) -> torch.Tensor:
    """Per layer, mean over ranks / max over ranks of ``loads`` `[layers, ranks]` (1.0: perfectly even; a layer with
    no load counts as 1.0). Returns `[layers]` float64."""
    loads = loads.double()
    peak = loads.max(dim=1).values
    return torch.where(peak > 0, loads.mean(dim=1) / peak.clamp(min=1e-300), 1.0)


def read_placement_json(path: str | Path, num_ranks: int) -> torch.Tensor:
    """A static placement in vllm-ascend's format (``{"moe_layer_count": N, "layer_list": [{"layer_id": i,
    "device_count": D, "device_list": [{"device_id": d, "device_expert": [logical ids]}]}]}``) as phy2log `[N, P]`
    int64: rank ``d``'s experts in local-slot order. Raises ValueError naming the file and what is wrong."""
    try:
        doc: Any = json.loads(Path(path).read_text())
        layers = sorted(doc["layer_list"], key=lambda item: int(item["layer_id"]))
        if len(layers) != int(doc["moe_layer_count"]):
            raise ValueError(f"moe_layer_count is {doc['moe_layer_count']} but layer_list has {len(layers)} layers")
        rows = []
        for layer in layers:
            devices = sorted(layer["device_list"], key=lambda d: int(d["device_id"]))
            if len(devices) != num_ranks or [int(d["device_id"]) for d in devices] != list(range(num_ranks)):
                raise ValueError(
                    f"layer {layer['layer_id']}: device_list must list devices 0..{num_ranks - 1} "
                    f"(the EP size), got {[d['device_id'] for d in devices]}"
                )
            widths = {len(d["device_expert"]) for d in devices}
            if len(widths) != 1:
                raise ValueError(
                    f"layer {layer['layer_id']}: every device must hold the same number of experts, "
                    f"got {sorted(widths)}"
                )
            rows.append([int(e) for d in devices for e in d["device_expert"]])
        if len({len(r) for r in rows}) > 1:
            raise ValueError("every layer must have the same number of physical experts")
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"expert placement {path}: {e}") from None
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)


def placement_json(phy2log: torch.Tensor, num_ranks: int) -> dict[str, Any]:
    """``phy2log`` `[layers, P]` in vllm-ascend's JSON format (the inverse of :func:`read_placement_json`)."""
    per_rank = phy2log.shape[1] // num_ranks
    layer_list = [
        {
            "layer_id": i,
            "device_count": num_ranks,
            "device_list": [
                {"device_id": d, "device_expert": row[d * per_rank : (d + 1) * per_rank]} for d in range(num_ranks)
            ],
        }
        for i, row in enumerate(phy2log.tolist())
    ]
    return {"moe_layer_count": phy2log.shape[0], "layer_list": layer_list}
