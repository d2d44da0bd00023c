"""Quantization numerics: Ascend int8 (per token, per 8-element group) and DeepEP fp8 e4m3 (per 128 channels).

All functions are pure and vectorized. Rounding is round-half-to-even (``torch.round``), as the NPU's ``rint``. DeepEP's
fp8: for every token and every group of 128 channels ``amax = max(max |x|, 1e-4)``, ``scale_inv = amax / 448`` (with
``round_scale``: rounded up to a power of two), ``q = e4m3(x / scale_inv)``; dequantize with ``q * scale_inv``. With
``use_ue8m0`` the (power-of-two) scales are stored as their 8-bit exponent (the float32 bits >> 23), four groups per
`torch.int32` (group g in byte ``g % 4`` of int ``g // 4``)."""

from __future__ import annotations

import torch


def per_token_int8(x: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascend ``quant_mode=2``: per-token dynamic int8 with optional smoothing. ``xf = fp32(x) * smooth``;
    ``q = int8(rint(xf * (127 / amax)))``; ``scale = amax / 127`` with ``amax = max |xf|`` over the row. A row of zeros
    gives ``q = 0`` and ``scale = 0`` (the NPU's result for ``amax = 0`` is not documented). ``x``:
    `[num_tokens, hidden]` `torch.bfloat16` / `torch.float16` / `torch.float32`; ``smooth_scales``:
    `[num_tokens, hidden]` or `[hidden]` `torch.float32`, or None. Returns ``q`` `[num_tokens, hidden]` `torch.int8` and
    ``scale`` `[num_tokens]` `torch.float32` (dequantize with ``q * scale[:, None]``)."""
    xf = x.float() if smooth_scales is None else x.float() * smooth_scales
    amax = xf.abs().amax(dim=-1) if xf.shape[-1] > 0 else xf.new_zeros(xf.shape[:-1])
    # tensor / tensor on purpose: ``127.0 / amax`` is computed as ``reciprocal(amax) * 127`` by torch (and a scalar
    # divisor may become a reciprocal multiply on GPU), which is 1 ulp off the formula and flips rint at .5 ties.
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, c127), torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, amax / c127


def per_group_int8(x: torch.Tensor, group: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``comm_quant_mode=2``: int8 with one scale per ``group`` consecutive elements, scale kept in x's dtype.
    ``scale = to_dtype(amax_g / 127)``; ``q = int8(rint(x / scale))``; dequantize with ``q * scale``. Groups of zeros
    give scale 0 and q 0. ``x``: `[num_tokens, hidden]` `torch.bfloat16` / `torch.float16` (`torch.float32` allowed),
    ``hidden`` a multiple of ``group``. Returns ``q`` `[num_tokens, hidden]` `torch.int8` and ``scale``
    `[num_tokens, hidden // group]` in x's dtype."""
    n, h = x.shape
    xg = x.float().view(n, h // group, group)
    amax = xg.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, 127.0)).to(x.dtype)
    sf = scale.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round(xg / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(xg))
    return q.clamp_(-127, 127).to(torch.int8).view(n, h), scale


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def scale_for_fp8_(work: torch.Tensor, x: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """Write ``x / scale_inv`` (clamped to the e4m3 range) into ``work`` and return ``scale_inv``; casting ``work`` to
    e4m3 (any ``copy_`` into a float8 tensor) completes the quantization. No temporaries of x's size. ``work``:
    `[num_tokens, hidden]` `torch.float32` (overwritten); ``x``: `[num_tokens, hidden]`, any float dtype,
    ``hidden % 128 == 0``; ``scale_inv``: `[num_tokens, hidden // 128]` `torch.float32`."""
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
    """Quantize rows to e4m3 with one scale per 128 channels (``round_scale``: each rounded up to a power of two).
    ``x``: `[num_tokens, hidden]` `torch.bfloat16` (any float dtype), ``hidden % 128 == 0``. Returns ``q``
    `[num_tokens, hidden]` `torch.float8_e4m3fn` and ``scale_inv`` `[num_tokens, hidden // 128]` `torch.float32`
    (dequantize: ``q * scale_inv`` per group)."""
    work = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scale_inv = scale_for_fp8_(work, x, round_scale)
    return work.to(FP8_DTYPE), scale_inv


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales `[..., G]` (G % 4 == 0) to their exponent bytes packed as `[..., G // 4]` int32."""
    exponent = (scale_inv.contiguous().flatten().view(torch.int32) >> 23).to(torch.uint8)
    return exponent.view(torch.int32).view(*scale_inv.shape[:-1], -1)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: `[..., G // 4]` int32 to `[..., G]` fp32 powers of two."""
    exponent = packed.contiguous().flatten().view(torch.uint8).to(torch.int32)
    return (exponent << 23).view(torch.float32).view(*packed.shape[:-1], -1)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantize `[..., hidden]` 8-bit data with per-128-channel scales (fp32 `[..., hidden // 128]`, or UE8M0 int32
    `[..., hidden // 512]`); returns `[..., hidden]` in ``out_dtype``."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    *lead, h = data.shape
    xg = data.float().reshape(*lead, h // GROUP, GROUP) * scales.float().unsqueeze(-1)
    return xg.reshape(*lead, h).to(out_dtype)
