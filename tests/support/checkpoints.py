"""Tiny HF checkpoints for the golden tests, built with transformers from config and saved with save_pretrained.

Routing is made decisive (router weights scaled up, so no fp32 noise can flip a top-k choice), DeepSeek's and GLM's
``e_score_correction_bias`` is randomised so the biased-selection path is exercised, and biases and norm weights are
randomised (transformers initialises them to 0 and 1, which would hide a misplaced one).
"""

from __future__ import annotations

import os

import torch

from server.random_model import DEEPSEEK_V3_MLA, DEEPSEEK_V3_ROUTING

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, eos_token_id=255)  # not Mixtral's
SMALL = dict(num_experts_per_tok=2, intermediate_size=32, eos_token_id=255)  # OLMoE, gpt-oss, Mixtral experts
ROUTER_SCALE = 25.0
# DeepSeek-V3 / R1's YaRN rope scaling as published (config.json; §2.6), less its type key
DEEPSEEK_V3_YARN = dict(
    factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0
)


def hf_config(arch: str, **overrides):  # noqa: ANN003, ANN201
    """A tiny transformers config of family ``arch`` (``overrides``: config fields)."""
    import transformers as tf

    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **{**COMMON, **MOE, "num_experts": 8, "shared_expert_intermediate_size": 48, **overrides}
        )
    if arch == "olmoe":
        return tf.OlmoeConfig(**{**COMMON, **SMALL, "num_experts": 8, **overrides})
    if arch == "gpt_oss":  # a 4-token window (prompts and decoding run past it), a clamp that bites
        window = {"sliding_window": 4, "swiglu_limit": 0.2}
        return tf.GptOssConfig(**{**COMMON, **SMALL, "head_dim": 16, "num_local_experts": 8, **window, **overrides})
    if arch == "glm4_moe":  # head_dim 16 (given, as GLM-4.5's config.json does), half of it rotary (the default)
        return tf.Glm4MoeConfig(
            **{
                **COMMON,
                **MOE,
                "head_dim": 16,
                "n_routed_experts": 8,
                **DEEPSEEK_V3_ROUTING,
                "use_qk_norm": True,
                "attention_bias": True,
                **overrides,
            }
        )

    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**COMMON, **MOE, "num_experts": 8, "head_dim": 16, **overrides})
    if arch == "deepseek_v3":  # HF's MLA needs num_key_value_heads == num_attention_heads
        mla = {**DEEPSEEK_V3_MLA, "kv_lora_rank": 16}  # the server's random DeepSeek-V3 sizes, a smaller KV rank
        return tf.DeepseekV3Config(
            **{
                **COMMON,
                "num_key_value_heads": 4,
                **MOE,
                "n_routed_experts": 8,
                **DEEPSEEK_V3_ROUTING,
                **mla,
                **overrides,
            }
        )
    if arch == "mixtral":
        return tf.MixtralConfig(**{**COMMON, **SMALL, "num_local_experts": 8, **overrides})
    raise ValueError(arch)


def make_checkpoint(arch: str, path: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> str:  # noqa: ANN003
    """Build (``overrides``: config fields), make routing decisive, randomise biases and norm weights,
    ``save_pretrained`` to ``path`` (in shards of ``max_shard_size`` when given); returns ``path``."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")):
                p.mul_(ROUTER_SCALE)
            elif name.endswith((".bias", "_bias")):
                p.copy_(torch.randn(p.shape) * 0.1)
            elif name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape))
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.5)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def load_hf(path: str):  # noqa: ANN201
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_steps: int) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN001
    """Greedy tokens and per-step last-position logits `[vocab]`, recomputing the full sequence every step."""
    ids, tokens, logits = list(prompt), [], []
    for _ in range(num_steps):
        last = model(torch.tensor([ids])).logits[0, -1].float()
        logits.append(last)
        tokens.append(int(last.argmax()))
        ids.append(tokens[-1])
    return tokens, logits
