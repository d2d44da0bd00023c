"""DeepEP's low-latency 8-bit numerics: per-token, per-128-channel float8 e4m3 with fp32 (or UE8M0) scales.

For every token and every group of 128 channels: ``amax = max(max |x|, 1e-4)``, ``scale_inv = amax / 448``
(with ``round_scale``: rounded up to a power of two, ``2 ** ceil(log2(scale_inv))``), ``q = e4m3(x / scale_inv)``.
Dequantize with ``q * scale_inv``. With ``use_ue8m0`` the (power-of-two) scales are stored as their 8-bit exponent
(the float32 bits >> 23), four groups per `torch.int32` (group g in byte ``g % 4`` of int ``g // 4``).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def scale_for_fp8_(work: torch.Tensor, x: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """Write ``x / scale_inv`` (clamped to the e4m3 range) into ``work`` and return ``scale_inv``; casting ``work``
    to e4m3 (any ``copy_`` into a float8 tensor) completes the quantization. No temporaries of x's size.

    Arguments:
        work: `[num_tokens, hidden]` with `torch.float32` (overwritten).
        x: `[num_tokens, hidden]`, any float dtype, ``hidden % 128 == 0``.

    Returns:
        scale_inv: `[num_tokens, hidden // 128]` with `torch.float32`.
    """
    n, h = x.shape
    work.copy_(x)
    wg = work.view(n, h // GROUP, GROUP)
    amax = torch.maximum(wg.amax(dim=-1), wg.amin(dim=-1).neg_()).clamp_(min=1e-4)
    scale_inv = amax.div_(FP8_MAX)
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    wg.div_(scale_inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return scale_inv


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to e4m3 with one scale per 128 channels.

    Arguments:
        x: `[num_tokens, hidden]` with `torch.bfloat16` (any float dtype), ``hidden % 128 == 0``.
        round_scale: round each scale up to a power of two.

    Returns:
        q: `[num_tokens, hidden]` with `torch.float8_e4m3fn`.
        scale_inv: `[num_tokens, hidden // 128]` with `torch.float32` (dequantize: ``q * scale_inv`` per group).
    """
    work = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scale_inv = scale_for_fp8_(work, x, round_scale)
    return work.to(FP8_DTYPE), scale_inv


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales `[..., G]` (G % 4 == 0) to their exponent bytes packed as `[..., G // 4]` int32."""
    lead = scale_inv.shape[:-1]
    exponent = (scale_inv.contiguous().flatten().view(torch.int32) >> 23).to(torch.uint8)
    return exponent.view(torch.int32).view(*lead, -1)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: `[..., G // 4]` int32 to `[..., G]` fp32 powers of two."""
    lead = packed.shape[:-1]
    exponent = packed.contiguous().flatten().view(torch.uint8).to(torch.int32)
    return (exponent << 23).view(torch.float32).view(*lead, -1)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantize `[..., hidden]` 8-bit data with per-128-channel scales (fp32 `[..., hidden // 128]`, or UE8M0
    int32 `[..., hidden // 512]`); returns `[..., hidden]` in ``out_dtype``."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    *lead, h = data.shape
    xg = data.float().reshape(*lead, h // GROUP, GROUP) * scales.float().unsqueeze(-1)
    return xg.reshape(*lead, h).to(out_dtype)
