"""The paged KV cache of one worker: fixed-size blocks that requests borrow through their block tables.

What one token costs: per layer, GQA caches its keys and values (``2 * num_key_value_heads * head_dim`` values);
MLA caches its compressed latent and the rotated shared key (``kv_lora_rank + qk_rope_head_dim`` values), in the
model dtype. A block holds ``block_size`` tokens of every layer. Which blocks a request owns is the driver's
business (:mod:`server.runtime.scheduling.block_manager`); the worker only reads and writes them.
"""

from __future__ import annotations

import math

import torch

from .attention import attention_class
from .config import ModelConfig


def layer_cache_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The per-token shape of each tensor one layer caches."""
    return attention_class(cfg).cache_shapes(cfg)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block (``block_size`` tokens, every layer) in ``dtype``."""
    per_token = sum(math.prod(shape) for shape in layer_cache_shapes(cfg)) * cfg.num_hidden_layers
    return per_token * block_size * torch.empty(0, dtype=dtype).element_size()


class PagedKVCache:
    """Per layer, one tensor per cached quantity, each `[num_blocks, block_size, *shape]` in the model dtype
    (:func:`layer_cache_shapes`). Zero-filled, so slots no request wrote hold finite values: attention gives them
    weight 0, and 0 times a finite value stays 0."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        shapes = layer_cache_shapes(cfg)
        self.layers = [
            [torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device) for shape in shapes]
            for _ in range(cfg.num_hidden_layers)
        ]
        self.num_blocks, self.block_size = num_blocks, block_size

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)
