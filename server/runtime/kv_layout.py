"""The KV layout a disaggregated instance announces (:class:`~server.disagg.layout.KVLayout`): what both sides of a
transfer must share, from the engine's config and the model's."""

from __future__ import annotations

import math

import torch

from server.disagg.layout import KVLayout
from server.loader import DTYPES
from server.models import ModelConfig
from server.models.kv_cache import layer_cache_shapes
from server.runtime.engine_config import EngineConfig


def kv_layout(config: EngineConfig, cfg: ModelConfig) -> KVLayout:
    """The layout of every worker's cache: per cache tensor (layer-major), the bytes of one token."""
    element = torch.empty(0, dtype=DTYPES[config.dtype]).element_size()
    shapes = layer_cache_shapes(cfg)
    token_bytes = tuple(math.prod(shape) * element for _ in range(cfg.num_hidden_layers) for shape in shapes)
    weights = "" if config.model is not None else f", random weights of seed {config.seed}"
    model = (
        f"{config.model_name} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_experts} experts{weights})"
    )
    return KVLayout(model, config.dtype, config.block_size, cfg.num_hidden_layers, token_bytes)
