"""``ModelConfig``: the architecture-independent view of an HF ``config.json`` that our model code reads."""

from __future__ import annotations

import dataclasses
from typing import Any

# HF ``architectures[0]`` -> our architecture key.
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and routing semantics of one MoE causal LM (fields named as in HF configs where they exist)."""

    architecture: str  # "qwen3_moe" | "deepseek_v3" | "mixtral"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one routed expert
    num_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # layer indices with a routed MoE block (others: dense MLP)
    # DeepSeek-V3 routing and shared experts.
    scoring: str = "softmax"  # "softmax" (Qwen3, Mixtral) | "sigmoid" (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # DeepSeek-V3 MLA.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def use_mla(self) -> bool:
        return self.architecture == "deepseek_v3"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed ``config.json`` (and optionally ``generation_config.json`` for EOS ids)."""
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"config.json architectures={archs!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported; only 'default' rotary embeddings are")
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        num_layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=_eos_ids(cfg, generation_config),
        )
        if arch == "qwen3_moe":
            num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
            step = int(cfg.get("decoder_sparse_step", 1))
            skip = set(cfg.get("mlp_only_layers") or [])
            moe = tuple(i for i in range(num_layers) if i not in skip and num_experts > 0 and (i + 1) % step == 0)
            return cls(
                **common,
                intermediate_size=int(cfg.get("intermediate_size", 0)),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                num_experts=num_experts,
                qk_norm=True,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=moe,
            )
        if arch == "mixtral":
            return cls(
                **common,
                intermediate_size=int(cfg["intermediate_size"]),
                moe_intermediate_size=int(cfg["intermediate_size"]),
                num_experts=int(cfg["num_local_experts"]),
                norm_topk_prob=True,
                moe_layers=tuple(range(num_layers)),
            )
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        rope_dim = int(cfg["qk_rope_head_dim"])
        return cls(
            **{**common, "head_dim": rope_dim},
            intermediate_size=int(cfg["intermediate_size"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            num_experts=int(cfg.get("n_routed_experts") or cfg["num_local_experts"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=tuple(range(first_dense, num_layers)),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            scoring="sigmoid",
            n_group=int(cfg.get("n_group", 1)),
            topk_group=int(cfg.get("topk_group", 1)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(cfg["v_head_dim"]),
        )


def _eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    for source in (generation_config or {}, cfg):
        eos = source.get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()
