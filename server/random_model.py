"""The random model: a small HF-style config from a spec and a seed, and its deterministic weights.

:func:`random_hf_config` turns a spec (architecture + sizes) into an HF-style ``config.json`` dict;
:class:`RandomTensors` draws every tensor from a generator seeded by (seed, tensor name), so every EP size gets the
same weights. The server serves it when no checkpoint is given.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .checkpoint.reads import Read
from .models.architectures import ARCHITECTURES

_ARCH_NAMES = {v: k for k, v in ARCHITECTURES.items()}

# The default random model: a small Qwen3-MoE (byte-level vocabulary + one EOS id).
RANDOM_DEFAULTS: dict[str, Any] = dict(
    architecture="qwen3_moe",
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    eos_token_id=256,
    max_position_embeddings=4096,
)
# What a random ``deepseek_v3`` model adds: grouped routing with one shared expert, and the MLA attention sizes.
DEEPSEEK_V3_ROUTING: dict[str, Any] = dict(
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_shared_experts=1
)
DEEPSEEK_V3_MLA: dict[str, Any] = dict(
    kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
)


def random_hf_config(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF-style ``config.json`` dict for a random model: :data:`RANDOM_DEFAULTS` overridden by ``spec``.

    ``architecture`` is one of :data:`~server.models.architectures.ARCHITECTURES`' keys (``qwen3_moe``, ...) or an
    HF class name; other keys are HF config field names. For ``deepseek_v3`` the grouped-routing and MLA defaults
    (:data:`DEEPSEEK_V3_ROUTING`, :data:`DEEPSEEK_V3_MLA`) are added, for ``glm4_moe`` the routing ones; for
    ``mixtral`` and ``olmoe`` the expert size is ``intermediate_size``; ``qwen2_moe``'s shared expert is twice an
    expert's size.
    """
    cfg = {**RANDOM_DEFAULTS, **(spec or {})}
    arch = cfg.pop("architecture")
    arch = ARCHITECTURES.get(arch, arch)
    if arch not in _ARCH_NAMES:
        raise ValueError(f"random_model architecture={arch!r} is not one of {sorted(_ARCH_NAMES)}")
    cfg["architectures"] = [_ARCH_NAMES[arch]]
    if arch in ("deepseek_v3", "glm4_moe"):
        extra = {**DEEPSEEK_V3_ROUTING, **(DEEPSEEK_V3_MLA if arch == "deepseek_v3" else {})}
        cfg = {"n_routed_experts": cfg.pop("num_experts"), **extra, **cfg}
    elif arch in ("mixtral", "olmoe"):
        cfg["num_local_experts" if arch == "mixtral" else "num_experts"] = cfg.pop("num_experts")
        cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")
    elif arch == "gpt_oss":
        cfg.update(num_local_experts=cfg.pop("num_experts"), intermediate_size=cfg.pop("moe_intermediate_size"))
    elif arch == "qwen2_moe":
        cfg.setdefault("shared_expert_intermediate_size", 2 * cfg["moe_intermediate_size"])
    return cfg


class RandomTensors:
    """Deterministic random tensors: ``N(0, 1/fan_in)`` for matrices, ones for norms, N(0, 1) embeddings."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def get(self, read: Read) -> torch.Tensor:
        """The tensor ``read`` names, drawn whole from its name's generator (its rows, in its layout)."""
        name, shape = read.name, read.shape
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.rand(shape, generator=gen) * 0.1
        else:
            std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
            t = torch.randn(shape, generator=gen) * std
        t = t if read.rows is None else t[read.rows.start : read.rows.stop]
        return t if read.layout is None else read.layout(t)
