"""Build a :class:`~server.models.model.MoECausalLM` on one EP rank from an HF checkpoint or from a seed.

Checkpoints are HF directories: ``config.json`` (+ optional ``generation_config.json``) and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Tensors are read one at a time through
``safetensors.safe_open`` and only those this rank needs: every shared weight, and of the routed experts only
``comm.local_expert_ids``, so a rank's peak memory holds its own experts only. The model is built uninitialised
and materialised directly in the target dtype (no random init, no second copy).

Without a checkpoint, :func:`random_hf_config` turns a small spec (architecture + sizes + seed) into an HF-style
config and every tensor is drawn from a generator seeded by (seed, tensor name): the same weights on any EP size.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .models.architectures import ARCHITECTURES
from .models.config import ModelConfig
from .models.ep_comm import ExpertComm
from .models.model import MoECausalLM
from .models.moe import Router

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ARCH_NAMES = {v: k for k, v in ARCHITECTURES.items()}
_EXPERT_PARAM = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(w13|w2)$")

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
    elif arch == "qwen2_moe":
        cfg.setdefault("shared_expert_intermediate_size", 2 * cfg["moe_intermediate_size"])
    return cfg


def read_config(model_path: str) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for EOS ids) of an HF checkpoint directory."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model={model_path!r} has no config.json (expected an HF checkpoint directory)")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    gen_path = os.path.join(model_path, "generation_config.json")
    gen = None
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            gen = json.load(f)
    return ModelConfig.from_hf(cfg, gen)


class CheckpointTensors:
    """Lazy tensor access by name across the safetensors files of one checkpoint directory."""

    def __init__(self, model_path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(model_path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        else:
            single = os.path.join(model_path, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"model={model_path!r} has neither model.safetensors nor an index.json")
            with safe_open(single, "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        self.weight_map: dict[str, str] = weight_map
        self._files = {name: safe_open(os.path.join(model_path, name), "pt") for name in set(weight_map.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        t = self._files[self.weight_map[name]].get_tensor(name)
        if t.shape != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the config needs {tuple(shape)}")
        return t


class RandomTensors:
    """Deterministic random tensors: ``N(0, 1/fan_in)`` for matrices, ones for norms, N(0, 1) embeddings."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __contains__(self, name: str) -> bool:
        return True  # every name can be drawn

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith("e_score_correction_bias"):
            return torch.rand(shape, generator=gen) * 0.1
        std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
        return torch.randn(shape, generator=gen) * std


@contextlib.contextmanager
def _no_init(dtype: torch.dtype) -> Iterator[None]:
    """Build with uninitialised parameters of ``dtype``: ``reset_parameters`` of torch layers is skipped (every
    value is loaded right after, so there is no random init and no second copy for a dtype cast)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.set_default_dtype(default_dtype)
        for cls, fn in saved:
            cls.reset_parameters = fn  # type: ignore[method-assign]


def build_model(
    cfg: ModelConfig,
    comm: ExpertComm,
    dtype: torch.dtype,
    tensors: CheckpointTensors | RandomTensors,
    device: torch.device | str = "cpu",
) -> MoECausalLM:
    """Create the rank's model on ``device`` and fill every parameter and buffer from ``tensors`` (routers stay
    fp32; each tensor is read on the CPU and copied to ``device``)."""
    with _no_init(dtype), torch.device(device):
        model = MoECausalLM(cfg, comm)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()
    get: Callable[[str, torch.Size], torch.Tensor] = tensors.get
    for name, t in model.state_dict(keep_vars=True).items():
        match = _EXPERT_PARAM.match(name)
        if match is None:
            src_name = name
            if name == "lm_head.weight" and (cfg.tie_word_embeddings or name not in tensors):
                src_name = "model.embed_tokens.weight"
            t.data.copy_(get(src_name, t.shape))
            continue
        layer, which = int(match.group(1)), match.group(2)
        inter = cfg.moe_intermediate_size
        for j, e in enumerate(comm.local_expert_ids):
            gate, up, down = model.expert_checkpoint_keys(layer, e)
            if which == "w13":
                t.data[j, :inter].copy_(get(gate, torch.Size((inter, cfg.hidden_size))))
                t.data[j, inter:].copy_(get(up, torch.Size((inter, cfg.hidden_size))))
            else:
                t.data[j].copy_(get(down, torch.Size((cfg.hidden_size, inter))))
    for moe in model.moe_layers():
        if moe.fused:
            moe.prepare_fused()
    model.eval()
    return model


def load_model(
    model_path: str | None,
    comm_factory: Callable[[ModelConfig], ExpertComm],
    dtype: str = "float32",
    seed: int = 0,
    random_model: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> MoECausalLM:
    """The rank's model from ``model_path`` (HF checkpoint dir) or, if None, the random model ``random_model``,
    on ``device``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    if model_path is None:
        cfg = ModelConfig.from_hf(random_hf_config(random_model))
        tensors: CheckpointTensors | RandomTensors = RandomTensors(seed)
    else:
        cfg = read_config(model_path)
        tensors = CheckpointTensors(model_path)
    return build_model(cfg, comm_factory(cfg), DTYPES[dtype], tensors, device)
