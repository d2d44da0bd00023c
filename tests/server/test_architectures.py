"""Greedy tokens equal transformers' for every family and checkpoint variant, at EP 1 (in process) and EP 2 (one
launch of two gloo ranks over ``deep_ep_npu.Buffer``, each holding half the experts, for all checkpoints).

Variants: each family as built by transformers, plus rope scaling (DeepSeek-V3 with YaRN as published, written in
the legacy ``rope_scaling`` form; linear, dynamic, llama3 and YaRN with an attention factor on GQA families), GLM-4.5
with q/k norms, attention bias and partial rotary, OLMoE with ``clip_qkv``, and a checkpoint saved in shards
(``model.safetensors.index.json``). The oracle is transformers' cached greedy decoding in fp32 (what ``dynamic``
rope's per-chunk frequencies follow); logits are also compared (within 1e-4), so a wrong scale cannot hide behind
equal argmaxes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from server.loader import load_model
from server.models import LocalComm
from tests.support.checkpoints import DEEPSEEK_V3_YARN, load_hf, make_checkpoint
from tests.support.distributed import parallel_launch
from tests.support.golden import PROMPTS, STEPS, check_close, ep2_rank, hf_cached_greedy, run_greedy

DEEPSEEK_YARN = {"type": "yarn", **DEEPSEEK_V3_YARN}  # the legacy rope_scaling form
# name -> (family, make_checkpoint keywords)
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "olmoe": ("olmoe", {}),
    "glm4_moe": ("glm4_moe", {}),
    "gpt_oss": ("gpt_oss", {}),
    "deepseek_v3_yarn": ("deepseek_v3", {"max_position_embeddings": 163840}),
    "qwen3_moe_linear": ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    "qwen3_moe_dynamic": (
        "qwen3_moe",
        {"max_position_embeddings": 8, "rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4}},
    ),
    "mixtral_llama3": (
        "mixtral",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e6,
            }
        },
    ),
    "olmoe_clip_yarn": (
        "olmoe",
        {
            "clip_qkv": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 1e4,
            },
        },
    ),
    "qwen2_moe_sharded": ("qwen2_moe", {"max_shard_size": "60KB", "mlp_only_layers": [0]}),
}


def _write_legacy_rope(path: str, rope_scaling: dict) -> None:
    """Rewrite ``config.json`` as published DeepSeek-V3 configs are: ``rope_scaling`` with ``type``, top-level
    ``rope_theta`` (transformers reads both forms)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(rope_scaling=rope_scaling, rope_theta=theta)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    paths = {}
    for name, (family, kwargs) in VARIANTS.items():
        paths[name] = make_checkpoint(family, str(tmp_path_factory.mktemp(name)), **kwargs)
        if name == "deepseek_v3_yarn":
            _write_legacy_rope(paths[name], DEEPSEEK_YARN)
    return paths


@pytest.fixture(scope="module")
def golden(checkpoints) -> dict[str, list[tuple[list[int], list[torch.Tensor]]]]:  # noqa: ANN001
    return {name: [hf_cached_greedy(load_hf(path), p, STEPS) for p in PROMPTS] for name, path in checkpoints.items()}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ep1_greedy_equals_transformers(name: str, checkpoints, golden) -> None:  # noqa: ANN001
    model = load_model(checkpoints[name], lambda cfg: LocalComm(cfg.num_experts, 64))
    for i, ours in enumerate(run_greedy(model, list(range(len(PROMPTS))), STEPS)):
        check_close(name, i, ours, golden[name][i])


def test_sharded_checkpoint_is_sharded(checkpoints) -> None:  # noqa: ANN001
    """The sharded variant really is: an index and several shards, with a layer's experts split across them."""
    path = checkpoints["qwen2_moe_sharded"]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    assert len(set(weight_map.values())) >= 3
    assert len({weight_map[k] for k in weight_map if ".mlp.experts." in k}) >= 2


def test_ep2_greedy_equals_transformers(checkpoints, golden) -> None:  # noqa: ANN001
    seen: dict[str, list[int]] = {name: [] for name in checkpoints}
    for per_rank in parallel_launch(2, ep2_rank, checkpoints, timeout=300):
        for name, results in per_rank.items():
            for i, ours in results:
                check_close(name, i, ours, golden[name][i])
                seen[name].append(i)
    assert all(sorted(v) == list(range(len(PROMPTS))) for v in seen.values()), seen
