"""Quantized checkpoints load exactly or are refused by name.

Each quantized checkpoint is made here from a bf16 model (every linear weight but the routers, embeddings and
``lm_head`` quantized as its format says; the rest stored in bf16): DeepSeek-native block fp8 (``weight_scale_inv``
on a block grid that does not divide the weights, so edge blocks are cropped), compressed-tensors int8 W8A8
(per-channel) and fp8 block, Ascend msmodelslim W8A8_DYNAMIC and gpt-oss MXFP4 experts. The oracle is transformers
running the dequantized weights (dequantized here by plain loops and lookups, independent of the server's code): greedy
tokens equal at EP 1 and EP 2, logits within 1e-4.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.checkpoint import CheckpointError
from server.loader import CheckpointTensors, load_model, read_config, read_hf_config
from server.models import LocalComm
from tests.support.checkpoints import load_hf, make_checkpoint
from tests.support.distributed import parallel_launch
from tests.support.golden import PROMPTS, STEPS, check_close, ep2_rank, hf_cached_greedy, run_greedy

FP8_BLOCK = (16, 24)  # 64- and 32-wide weights: partial blocks at the edges
CT_INT8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}
CT_FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "block",
                "block_structure": list(FP8_BLOCK),
                "dynamic": False,
            },
        }
    },
}
# name -> (family, format)
VARIANTS = {
    "deepseek_v3_fp8": ("deepseek_v3", "fp8"),
    "qwen3_moe_ct_int8": ("qwen3_moe", "ct_int8"),
    "mixtral_ct_fp8_block": ("mixtral", "ct_fp8_block"),
    "qwen2_moe_w8a8_dynamic": ("qwen2_moe", "msmodelslim"),
    "gpt_oss_mxfp4": ("gpt_oss", "mxfp4"),
}
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _quantized(name: str, t: torch.Tensor) -> bool:
    """Which tensors the formats quantize: linear weights, not routers / embeddings / lm_head / norms."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: scale = amax / 448, q = fp8(w / scale); returns (q, scale grid, dequantized fp32)."""
    (n, k), (bn, bk) = w.shape, FP8_BLOCK
    grid = torch.empty((n + bn - 1) // bn, (k + bk - 1) // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    deq = torch.empty(n, k)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            grid[i, j] = block.abs().max() / 448
            q_block = (block / grid[i, j]).to(torch.float8_e4m3fn)
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = q_block
            deq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = q_block.float() * grid[i, j]
    return q, grid, deq


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output row: scale = amax / 127, q = round(w / scale); returns (q, scale [N, 1] bf16, dequantized)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16)
    q = torch.round(w.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale, q.float() * scale.float()


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss' fused expert weight ``w`` `[E, in, out]` -> (blocks `[E, out, in / 32, 16]` uint8, scales `[E, out,
    in / 32]` uint8, dequantized `[E, in, out]`): per 32 inputs, scale 2^ceil(log2(amax / 6)), each value the
    nearest FP4 code, two codes a byte (the low nibble first)."""
    rows = w.float().transpose(1, 2)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(dim=-1) / 6)).clamp(-127, 127)
    codes = (groups[..., None] / torch.exp2(exponent)[..., None, None] - FP4).abs().argmin(dim=-1)
    deq = (FP4[codes] * torch.exp2(exponent)[..., None]).reshape(rows.shape).transpose(1, 2).contiguous()
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), deq


def quantize_checkpoint(src: str, dst: str, fmt: str) -> dict[str, torch.Tensor]:
    """Write ``src`` (fp32) as a bf16 model quantized in format ``fmt`` to ``dst``; returns the dequantized state."""
    shutil.copytree(src, dst)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    out, deq, description = {}, {}, {}
    for name, w in state.items():
        description[name] = "FLOAT"
        if fmt == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"], deq[name] = _mxfp4(w)
            continue
        if fmt == "mxfp4" or not _quantized(name, w):
            out[name], deq[name] = w, w.float()
            continue
        base = name.removesuffix("weight")
        if fmt in ("fp8", "ct_fp8_block"):
            out[name], scale, deq[name] = _fp8_blocks(w)
            out[base + ("weight_scale_inv" if fmt == "fp8" else "weight_scale")] = scale
        else:
            out[name], out[base + "weight_scale"], deq[name] = _int8_rows(w)
            if fmt == "msmodelslim":
                out[base + "weight_offset"] = torch.zeros_like(out[base + "weight_scale"])
                for suffix in ("weight", "weight_scale", "weight_offset"):
                    description[base + suffix] = "W8A8_DYNAMIC"
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    if fmt == "msmodelslim":
        with open(os.path.join(dst, "quant_model_description.json"), "w") as f:
            json.dump({"model_quant_type": "W8A8_DYNAMIC", **description}, f)
    else:
        fp8 = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
        mxfp4 = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "lm_head",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
            ],
        }
        cfg["quantization_config"] = {"fp8": fp8, "ct_int8": CT_INT8, "ct_fp8_block": CT_FP8_BLOCK, "mxfp4": mxfp4}[fmt]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, tuple[str, list]]:  # noqa: ANN001
    """name -> (quantized checkpoint dir, transformers' greedy tokens / logits on the dequantized weights)."""
    out = {}
    for name, (family, fmt) in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        src = make_checkpoint(family, str(root / "fp32"))
        deq = quantize_checkpoint(src, str(root / "quantized"), fmt)
        save_file(deq, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})  # the oracle's weights
        hf = load_hf(src)
        out[name] = (str(root / "quantized"), [hf_cached_greedy(hf, p, STEPS) for p in PROMPTS])
    return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ep1_greedy_equals_transformers_on_dequantized_weights(name: str, quantized) -> None:  # noqa: ANN001
    path, golden = quantized[name]
    assert type(CheckpointTensors(path, read_hf_config(path)[0]).format).__name__ != "WeightFormat"
    model = load_model(path, lambda cfg: LocalComm(cfg.num_experts, 64))
    for i, ours in enumerate(run_greedy(model, list(range(len(PROMPTS))), STEPS)):
        check_close(name, i, ours, golden[i])


def test_ep2_greedy_equals_transformers_on_dequantized_weights(quantized) -> None:  # noqa: ANN001
    paths = {name: path for name, (path, _) in quantized.items()}
    for per_rank in parallel_launch(2, ep2_rank, paths, timeout=300):
        for name, results in per_rank.items():
            for i, ours in results:
                check_close(name, i, ours, quantized[name][1][i])


def test_int8_experts_keep_the_checkpoints_int8_weights(quantized) -> None:  # noqa: ANN001
    """With int8 experts, a W8A8 checkpoint's experts run on its own int8 values and (to float rounding) scales:
    requantizing the dequantized rows gives them back."""
    path, _ = quantized["qwen3_moe_ct_int8"]
    stored = load_file(os.path.join(path, "model.safetensors"))
    model = load_model(path, lambda cfg: LocalComm(cfg.num_experts, 64))
    for moe in model.moe_layers():
        moe.experts.quantize_int8()
    layer = model.moe_layers()[0]
    layer_idx = next(i for i, lay in enumerate(model.model.layers) if lay.is_moe)
    w13, w2 = layer.experts.int8[3]  # type: ignore[index]
    prefix = f"model.layers.{layer_idx}.mlp.experts.3."
    gate_up = torch.cat([stored[prefix + "gate_proj.weight"], stored[prefix + "up_proj.weight"]])
    assert torch.equal(w13.weight_t.t(), gate_up)
    assert torch.equal(w2.weight_t.t(), stored[prefix + "down_proj.weight"])
    torch.testing.assert_close(w2.scale.t(), stored[prefix + "down_proj.weight_scale"].float(), rtol=1e-6, atol=0)


def _with_quant_config(tmp_path, qc: dict) -> str:  # noqa: ANN001
    path = make_checkpoint("qwen3_moe", str(tmp_path / "q"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not supported; supported: fp8"),
        ({"bits": 4}, "quant_method=None is not supported"),
        ({**CT_INT8, "format": "pack-quantized"}, "format='pack-quantized' is not supported"),
        (
            {
                **CT_INT8,
                "config_groups": {
                    "g": {
                        "format": "int-quantized",
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            r"g.weights: num_bits=4 type='int' strategy='group' is not supported",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\] must be"),
    ],
)
def test_unsupported_quantization_fails_at_start_up_naming_it(tmp_path, qc: dict, match: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckpointError, match=match):
        read_config(_with_quant_config(tmp_path, qc))


def test_msmodelslim_static_w8a8_is_refused(quantized, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "static")
    shutil.copytree(quantized["qwen2_moe_w8a8_dynamic"][0], path)
    desc_path = os.path.join(path, "quant_model_description.json")
    with open(desc_path) as f:
        desc = json.load(f)
    desc = {k: ("W8A8" if v == "W8A8_DYNAMIC" else v) for k, v in desc.items()}
    with open(desc_path, "w") as f:
        json.dump(desc, f)
    with pytest.raises(CheckpointError, match=r"is quantized as 'W8A8', which is not supported; supported: "):
        read_config(path)


def test_a_missing_scale_is_named(quantized, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "noscale")
    shutil.copytree(quantized["deepseek_v3_fp8"][0], path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    tensors.pop(name)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing .the scale of fp8 weight"):
        read_config(path)
