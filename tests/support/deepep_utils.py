"""Test helpers in the spirit of DeepEP's ``tests/utils.py`` (written anew; independent of deep_ep_npu's code)."""

from __future__ import annotations

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity metric: ``1 - 2 * sum(x * y) / sum(x^2 + y^2)`` on ``x + 1``, ``y + 1`` in float64."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize `[..., H]` 8-bit data with per-128-channel scales `[..., H / 128]` fp32, or UE8M0 exponent bytes
    packed 4 per int32 `[..., H / 512]`; returns bfloat16."""
    if data.numel() == 0:
        return data.to(torch.bfloat16)
    if scales.dtype == torch.int32:
        lead = scales.shape[:-1]
        exponent_bytes = scales.contiguous().flatten().view(torch.uint8).to(torch.int32)
        scales = (exponent_bytes << 23).view(torch.float32).view(*lead, -1)
    h = data.shape[-1]
    grouped = data.to(torch.float32).reshape(-1, h // 128, 128)
    out = grouped * scales.reshape(-1, h // 128, 1).float()
    return out.reshape(data.shape).to(torch.bfloat16)


def fp8_e4m3_reference(x: torch.Tensor, round_scale: bool) -> torch.Tensor:
    """Single-process oracle of DeepEP's per-token, per-128-channel e4m3 round trip, returned as bfloat16."""
    n, h = x.shape
    xg = x.float().view(n, h // 128, 128)
    amax = xg.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
    scale_inv = amax / 448.0
    if round_scale:
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(scale_inv)))
    q = (xg / scale_inv).to(torch.float8_e4m3fn)
    return (q.float() * scale_inv).view(n, h).to(torch.bfloat16)


def hash_tensor(t: torch.Tensor) -> int:
    """DeepEP's cheap content hash: the tensor's bytes as int64 words, summed."""
    flat = t.contiguous().view(torch.uint8).flatten()
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return int(flat.view(torch.int64).sum())
