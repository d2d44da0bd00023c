"""``ModelConfig``: the architecture-independent view of an HF ``config.json`` that our model code reads.

How each family's ``config.json`` maps onto it is :mod:`server.models.architectures`.
"""

from __future__ import annotations

import dataclasses

from .rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes, attention and routing semantics and checkpoint names of one MoE causal LM (fields named as in HF
    configs where they exist)."""

    architecture: str  # a key of server.models.architectures.ARCHITECTURES' values, e.g. "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # GQA head size; DeepSeek-V3: qk_rope_head_dim
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one routed expert
    num_experts: int
    num_experts_per_tok: int
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    rms_norm_eps: float = 1e-6
    norm_weight_fp32: bool = False  # gpt-oss: RMSNorm multiplies by its weight in fp32, then casts (Llama: casts first)
    rope_interleave: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Attention.
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "head": RMSNorm over head_dim per head (Qwen3, GLM); "full": over the projection (OLMoE)
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention" (empty: all full)
    sliding_window: int = 0  # keys a sliding layer attends to (the query's own included)
    attention_sinks: bool = False  # gpt-oss: one learned logit per head in every softmax denominator
    # Routing.
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # layer indices with a routed MoE block (others: dense MLP)
    scoring: str = "softmax"  # "softmax" (then top-k) | "sigmoid" (DeepSeek-V3, GLM) | "topk_softmax" (gpt-oss)
    router_bias: bool = False  # gpt-oss: the router linear has a bias
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    routing_skew: float = 0.0  # load tests (ours, config key "routing_skew"): top-k drawn from Zipf(s) over experts
    # Experts.
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output x sigmoid(shared_expert_gate(x))
    expert_bias: bool = False  # gpt-oss: gate/up and down projections with biases
    swiglu_limit: float | None = None  # gpt-oss: clamped SwiGLU (gate <= limit, |up| <= limit), (up + 1) * glu
    swiglu_alpha: float = 1.702  # gpt-oss: glu = gate * sigmoid(alpha * gate)
    # Checkpoint names.
    moe_block: str = "mlp"  # Mixtral: "block_sparse_moe"
    router_name: str = "gate"  # gpt-oss: "router"
    shared_expert_name: str = "shared_experts"  # Qwen2-MoE: "shared_expert"
    expert_keys: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    fused_experts: bool = False  # gpt-oss: experts.{gate_up_proj,down_proj}[_bias] hold every expert of a layer
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

    def is_sliding(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == "sliding_attention"

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> ModelConfig:
        """Build from a parsed ``config.json`` (and optionally ``generation_config.json`` for EOS ids)."""
        from .architectures import parse_hf_config

        return cls(**parse_hf_config(cfg, generation_config))
