"""Rope scaling against transformers' own functions: every type's frequencies and cos / sin factor bit-equal, the
DeepSeek-V3 softmax scale equal, unsupported types refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from server.models.rope import RopeConfig, Rotary
from tests.support.checkpoints import DEEPSEEK_V3_YARN

# (rope parameters, top-level config fields) per case; max_position_embeddings 4096 unless given
CASES = {
    "default": ({"rope_type": "default", "rope_theta": 1e6}, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}, {"max_position_embeddings": 64}),
    "yarn_deepseek_v3": (
        {"rope_type": "yarn", **DEEPSEEK_V3_YARN, "rope_theta": 10000.0},
        {"max_position_embeddings": 163840},
    ),
    "yarn_kimi_k2": (
        {
            "rope_type": "yarn",
            "factor": 32,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 50000.0,
        },
        {"max_position_embeddings": 131072},
    ),
    "yarn_gpt_oss": (
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "rope_theta": 150000.0,
        },
        {"max_position_embeddings": 131072},
    ),
    "yarn_mscale_ratio": (
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
        },
        {},
    ),
    "yarn_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "attention_factor": 0.9,
            "rope_theta": 10000.0,
        },
        {},
    ),
    "yarn_factor_from_lengths": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024, "rope_theta": 10000.0},
        {},
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
        {},
    ),
    "partial": ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, {}),
}


def _hf_config(params: dict, top: dict, head_dim: int = 64):  # noqa: ANN202
    import transformers as tf

    top = {"max_position_embeddings": 4096, **top}
    return tf.Qwen3MoeConfig(rope_parameters=dict(params), head_dim=head_dim, **top)


def _ours(params: dict, top: dict, head_dim: int = 64) -> RopeConfig:
    cfg = {"rope_parameters": params, "max_position_embeddings": 4096, **top}
    return RopeConfig.from_hf(cfg, head_dim)


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_factor_equal_transformers(case: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, top = CASES[case]
    hf = _hf_config(params, top)
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        ref, ref_factor = Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(hf)
        if "partial_rotary_factor" in params:  # HF's default path ignores it; its partial models' rope functions do not
            ref = ROPE_INIT_FUNCTIONS["linear"](_hf_config({**params, "factor": 1.0}, top), None)[0]
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf, None)
    inv, factor = _ours(params, top).inv_freq()
    assert torch.equal(inv, ref), (inv, ref)
    assert factor == ref_factor


def test_dynamic_frequencies_grow_as_transformers() -> None:
    """Past max_position_embeddings the NTK frequencies equal those transformers computes while generating (a tensor
    sequence length); at or under it, the initial ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, top = CASES["dynamic"]
    hf, ours = _hf_config(params, top), _ours(params, top)
    rotary = Rotary(ours)
    for length in (1, 64, 65, 100, 1000):
        ref = ROPE_INIT_FUNCTIONS["dynamic"](hf, None, seq_len=torch.tensor(length))[0]
        if length <= 64:
            ref = ROPE_INIT_FUNCTIONS["dynamic"](hf, None)[0]
        positions = torch.tensor([length - 1])
        cos, _ = rotary.cos_sin(positions, torch.float32, torch.tensor([length]))
        expected = torch.cat([positions.float()[:, None] * ref[None, :]] * 2, dim=-1).cos()
        assert torch.equal(cos, expected), length


@pytest.mark.parametrize("case", ["default", "yarn_deepseek_v3", "yarn_kimi_k2", "yarn_mscale_ratio"])
def test_deepseek_softmax_scale_equals_transformers(case: str) -> None:
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    params, top = CASES[case]
    top = {"max_position_embeddings": 4096, **top}
    hf = tf.DeepseekV3Config(
        rope_parameters=dict(params),
        **top,
        hidden_size=64,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    ref = DeepseekV3Attention(hf, 0).scaling
    mscale = _ours(params, top, head_dim=8).mla_mscale()
    assert 24**-0.5 * mscale * mscale == ref
    if case == "yarn_deepseek_v3":  # the published DeepSeek-V3 / R1 factor (DeepSeek-V3's config.json)
        assert math.isclose(mscale * mscale, 1.8739, abs_tol=1e-4)


def test_legacy_rope_scaling_wins_over_rope_parameters() -> None:
    cfg = {
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "default"},
        "rope_theta": 500.0,
    }
    rope = RopeConfig.from_hf(cfg, 16)
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 2.0, 500.0)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope_type='longrope' is not supp"),
        ({"rope_type": "su"}, "rope_type='su' is not supported; supported: .*'yarn'"),
        ({"rope_type": "linear"}, "rope_type='linear' needs rope parameter 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0}, "needs rope parameter 'low_freq_factor'"),
    ],
)
def test_unsupported_rope_is_refused_by_name(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeConfig.from_hf({"rope_scaling": params}, 16)
