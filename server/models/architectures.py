"""The MoE families we serve: how each one's ``config.json`` maps onto :class:`~server.models.config.ModelConfig`.

Values missing from a ``config.json`` take the defaults of that family's transformers config class (5.24); what a family
cannot run here (a sliding window on Qwen / Mixtral, a ``hidden_act`` other than silu) is refused by name. Each family's
transformers model code (https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models) is the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .rope import RopeConfig

# HF ``architectures[0]`` -> our architecture key.
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# gpt-oss' rope when config.json gives none (transformers' GptOssConfig default).
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

Parser = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


def parse_hf_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a parsed ``config.json``. Raises ValueError naming the field and value
    that is not supported."""
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"config.json architectures={archs!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported for {archs[0]}; supported: 'silu'")
    heads = int(cfg["num_attention_heads"])
    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(cfg, generation_config),
        routing_skew=float(cfg.get("routing_skew", 0.0)),
    )
    return {**common, **_PARSERS[arch](cfg, common)}


def _eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    """Every EOS id of ``generation_config.json`` and ``config.json`` (generation stops on any of them)."""
    ids: list[int] = []
    for source in (generation_config or {}, cfg):
        eos = source.get("eos_token_id")
        if eos is not None:
            ids += [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return tuple(dict.fromkeys(ids))


def _layers(cfg: dict[str, Any], num_layers: int, first_dense: int = 0) -> tuple[int, ...]:
    """MoE layers by ``mlp_only_layers`` / ``decoder_sparse_step`` (Qwen) and ``first_k_dense_replace`` (DeepSeek,
    GLM)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    skip = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(first_dense, num_layers) if i not in skip and (i + 1) % step == 0)


def _no_sliding(cfg: dict[str, Any], family: str) -> None:
    sliding = cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ())
    if family == "mixtral":
        sliding = cfg.get("sliding_window") is not None
    if sliding:
        raise ValueError(
            f"config.json: sliding-window attention ({family}: use_sliding_window / sliding_window / "
            "layer_types) is not supported for this family; serve it with the window off"
        )


def _qwen3_moe(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _no_sliding(cfg, "qwen3_moe")
    num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts=num_experts,
        rope=RopeConfig.from_hf(cfg, common["head_dim"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=_layers(cfg, common["num_hidden_layers"]) if num_experts > 0 else (),
    )


def _qwen2_moe(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _no_sliding(cfg, "qwen2_moe")
    num_experts = int(cfg.get("num_experts", 60))
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", 5632)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408)),
        num_experts=num_experts,
        rope=RopeConfig.from_hf(cfg, common["head_dim"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=_layers(cfg, common["num_hidden_layers"]) if num_experts > 0 else (),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 5632)),
        shared_expert_gate=True,
        shared_expert_name="shared_expert",
    )


def _olmoe(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    if common["head_dim"] * common["num_attention_heads"] != common["hidden_size"]:
        raise ValueError(
            "config.json: OLMoE needs head_dim * num_attention_heads == hidden_size (its q/k norms span "
            f"the projections), got head_dim={common['head_dim']}"
        )
    clip = cfg.get("clip_qkv")
    return dict(
        intermediate_size=0,
        moe_intermediate_size=int(cfg.get("intermediate_size", 2048)),
        num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 64),
        rope=RopeConfig.from_hf(cfg, common["head_dim"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=tuple(range(common["num_hidden_layers"])),
    )


def _mixtral(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    _no_sliding(cfg, "mixtral")
    return dict(
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        num_experts=int(cfg["num_local_experts"]),
        rope=RopeConfig.from_hf(cfg, common["head_dim"], default_theta=1e6),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        norm_topk_prob=True,
        moe_layers=tuple(range(common["num_hidden_layers"])),
        moe_block="block_sparse_moe",
        expert_keys=("w1", "w3", "w2"),
    )


def _sigmoid_routing(cfg: dict[str, Any], first_dense: int, num_layers: int) -> dict[str, Any]:
    """DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores, grouped top-k, shared experts."""
    moe_inter = int(cfg["moe_intermediate_size"])
    return dict(
        moe_intermediate_size=moe_inter,
        num_experts=int(cfg.get("n_routed_experts") or cfg["num_local_experts"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=tuple(range(first_dense, num_layers)),
        scoring="sigmoid",
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=moe_inter * int(cfg.get("n_shared_experts") or 0),
    )


def _deepseek_v3(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    rope_dim = int(cfg["qk_rope_head_dim"])
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        **_sigmoid_routing(cfg, int(cfg.get("first_k_dense_replace", 0)), common["num_hidden_layers"]),
        head_dim=rope_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        rope=RopeConfig.from_hf(cfg, rope_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        qkv_bias=bias,
        o_bias=bias,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg["v_head_dim"]),
    )


def _glm4_moe(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    return dict(
        **_sigmoid_routing(cfg, int(cfg.get("first_k_dense_replace", 1)), common["num_hidden_layers"]),
        intermediate_size=int(cfg.get("intermediate_size", 10944)),
        rope=RopeConfig.from_hf(cfg, common["head_dim"], default_partial_rotary_factor=0.5),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm="head" if cfg.get("use_qk_norm", False) else "none",
    )


def _gpt_oss(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    layers, head_dim = common["num_hidden_layers"], int(cfg.get("head_dim") or 64)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = bool(cfg.get("attention_bias", True))
    if not (cfg.get("rope_scaling") or cfg.get("rope_parameters")):
        cfg = {**cfg, "rope_parameters": GPT_OSS_ROPE}
    return dict(
        head_dim=head_dim,
        intermediate_size=0,
        moe_intermediate_size=int(cfg.get("intermediate_size", 2880)),
        num_experts=int(cfg.get("num_local_experts", 128)),
        rope=RopeConfig.from_hf(cfg, head_dim, default_theta=150000.0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        norm_weight_fp32=True,
        qkv_bias=bias,
        o_bias=bias,
        layer_types=tuple(types),
        sliding_window=int(cfg.get("sliding_window") or 0),
        attention_sinks=True,
        moe_layers=tuple(range(layers)),
        scoring="topk_softmax",
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        router_name="router",
        fused_experts=True,
    )


_PARSERS: dict[str, Parser] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "olmoe": _olmoe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
}
