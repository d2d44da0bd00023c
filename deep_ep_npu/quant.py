"""Quantization numerics: Ascend's dispatch quant modes (:class:`Quant`: 2 per token int8 / fp8, 3 fp8 per 128
channels, 4 MX fp8 per 32 with e8m0 scales), combine's int8 per 8 elements, DeepEP's fp8 e4m3 per 128 channels.

Pure and vectorized; rounding is half-to-even (the NPU's ``rint``; for float8 the cast itself) after clamping to the
target's largest finite value (448 e4m3, 57344 e5m2, 127 int8). DeepEP's fp8, per token and 128 channels:
``scale_inv = max(amax, 1e-4) / 448`` (``round_scale``: up to a power of two), ``q = e4m3(x / scale_inv)``; UE8M0
packs the power-of-two scales' exponent bytes four per int32. Non-finite input propagates through the scales: a row
(int8: a group) holding NaN / Inf gets a NaN / Inf scale and int8 data 0, so it dequantizes to NaN."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # maxV of each target
MX_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # exponent of the largest power of two below maxV
E8M0 = torch.float8_e8m0fnu
FP8_DTYPE, FP8_MAX, GROUP = torch.float8_e4m3fn, 448.0, 128  # DeepEP's fp8: e4m3 per 128 channels
Quantized = tuple[torch.Tensor, torch.Tensor]  # (q, scales)


def per_token(x: torch.Tensor, smooth_scales: torch.Tensor | None = None, dtype: torch.dtype = torch.int8) -> Quantized:
    """Ascend ``quant_mode=2``: per-token dynamic quant with optional smoothing. ``xf = fp32(x) * smooth``;
    ``q = rint(xf * (maxV / amax))`` (clamped to ``+-maxV``; for float8 the rounding is the cast);
    ``scale = amax / maxV`` with ``amax = max |xf|`` over the row (true divisions). A row of zeros gives ``q = 0`` and
    ``scale = 0`` (the NPU's result for ``amax = 0`` is not documented). ``x``: `[num_tokens, hidden]`
    `torch.bfloat16` / `torch.float16` / `torch.float32`; ``smooth_scales``: `[num_tokens, hidden]` or `[hidden]`
    `torch.float32`, or None; ``dtype``: `torch.int8`, `torch.float8_e4m3fn` or `torch.float8_e5m2`. Returns ``q``
    `[num_tokens, hidden]` ``dtype`` and ``scale`` `[num_tokens]` `torch.float32` (dequantize with
    ``q * scale[:, None]``)."""
    xf = x.float() if smooth_scales is None else x.float() * smooth_scales
    amax = xf.abs().amax(dim=-1) if xf.shape[-1] > 0 else xf.new_zeros(xf.shape[:-1])
    # tensor / tensor on purpose: ``127.0 / amax`` is computed as ``reciprocal(amax) * 127`` by torch (and a scalar
    # divisor may become a reciprocal multiply on GPU), which is 1 ulp off the formula and flips rint at .5 ties.
    vmax = torch.full_like(amax, MAX[dtype])
    inv = torch.where(amax > 0, vmax / torch.where(amax > 0, amax, vmax), torch.zeros_like(amax))
    q = xf * inv.unsqueeze(-1)
    q = torch.round(q).nan_to_num_(nan=0.0) if dtype == torch.int8 else q  # NaN: a row with NaN / Inf (module doc)
    return q.clamp_(-MAX[dtype], MAX[dtype]).to(dtype), amax / vmax


per_token_int8 = per_token  # Ascend ``quant_mode=2`` into int8 (per_token's default dtype)


def _blocks(xf: torch.Tensor, size: int) -> torch.Tensor:
    """`[n, hidden]` fp32 as `[n, ceil(hidden / size), size]`, the last block zero-padded."""
    n, h = xf.shape
    return torch.nn.functional.pad(xf, (0, -h % size)).view(n, -(-h // size), size)


def per_group_fp8(x: torch.Tensor, smooth: torch.Tensor | None, dtype: torch.dtype, group: int = 128) -> Quantized:
    """Ascend ``quant_mode=3``: per ``group`` channels (the last group may be shorter) ``amax_g = max |xf_g|``,
    ``scale_g = amax_g / maxV``, ``q = cast(xf / scale_g)`` (true divisions; a zero group gives scale 0 and q 0), with
    ``xf = fp32(x) * smooth`` as in :func:`per_token`. Returns ``q`` `[n, hidden]` ``dtype`` (float8) and ``scale``
    `[n, ceil(hidden / group)]` `torch.float32` (dequantize: ``q * scale`` per group)."""
    xf = x.float() if smooth is None else x.float() * smooth
    xg = _blocks(xf, group)
    amax = xg.abs().amax(dim=-1)
    scale = amax / torch.full_like(amax, MAX[dtype])
    sf = scale.unsqueeze(-1)
    q = torch.where(sf > 0, xg / torch.where(sf > 0, sf, torch.ones_like(sf)), torch.zeros_like(xg))
    q = q.clamp_(-MAX[dtype], MAX[dtype]).flatten(1)[:, : xf.shape[1]]  # flatten: also for 0 rows
    return q.to(dtype), scale


def mx_fp8(x: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """Ascend ``quant_mode=4`` (MX) into float8: per 32-element block (the last may be shorter) the e8m0 code
    ``c = max(floor(log2 amax) + 127 - emax, 0)`` (emax 8 e4m3, 15 e5m2; 0 for an all-zero block, 0xFF for a block
    holding Inf / NaN), elements ``q = cast(clamp(x / 2^(c - 127), +-maxV))`` (exact power-of-two scaling; the cast
    rounds to nearest even; values in ``(maxV, 2^(emax + 1))`` saturate; an Inf / NaN block is cast unscaled).
    Returns ``q`` `[n, hidden]` ``dtype`` and the codes `[n, align2(ceil(hidden / 32))]` `torch.float8_e8m0fnu`
    (the padding entry is code 0); dequantize with :func:`mx_dequant`."""
    xg = _blocks(x.float(), 32)
    amax = xg.abs().amax(dim=-1)
    code = (torch.frexp(amax).exponent - 1 + 127 - MX_EMAX[dtype]).clamp_(min=0)  # frexp: amax = m * 2^e, m in [.5, 1)
    code = torch.where(amax == 0, 0, torch.where(torch.isfinite(amax), code, 255))
    unscale = torch.where(code == 255, 127, 254 - code).to(torch.uint8).view(E8M0).float()  # 2^(127 - c)
    q = (xg * unscale.unsqueeze(-1)).clamp_(-MAX[dtype], MAX[dtype]).flatten(1)[:, : x.shape[1]]
    codes = torch.nn.functional.pad(code.to(torch.uint8), (0, code.shape[1] % 2))
    return q.to(dtype), codes.view(E8M0)


def mx_clip_fp8(x: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """Ascend ``quant_mode=5`` (MX_CLIP) into float8: per 32-element block ``m = max |x|``; the e8m0 code is
    ``ceil(log2(max(m, 1e-4) * fp32(1 / maxV))) + 127`` (0 for an all-zero block, 0xFF for a block holding Inf / NaN),
    so ``|x| / scale <= maxV``; elements ``cast(x * 2^(127 - code))`` (round to nearest even, saturating). Same
    outputs as :func:`mx_fp8`."""
    xg = _blocks(x.float(), 32)
    amax = xg.abs().amax(dim=-1)
    y = amax.clamp(min=1e-4) * torch.tensor(1.0 / MAX[dtype], dtype=torch.float32)
    mant, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [.5, 1): ceil(log2 y) = exp - (mant == .5)
    code = (exp - (mant == 0.5).to(exp.dtype) + 127).clamp_(0, 254)
    code = torch.where(amax == 0, 0, torch.where(torch.isfinite(amax), code, 255))
    unscale = torch.where(code == 255, 127, 254 - code).to(torch.uint8).view(E8M0).float()
    unscale = torch.where(code.unsqueeze(-1) == 255, float("nan"), unscale.unsqueeze(-1))
    q = (xg * unscale).clamp_(-MAX[dtype], MAX[dtype]).flatten(1)[:, : x.shape[1]]
    codes = torch.nn.functional.pad(code.to(torch.uint8), (0, code.shape[1] % 2))
    return q.to(dtype), codes.view(E8M0)


def mx_dequant(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`[n, hidden]` fp32 ``q * 2^(c - 127)`` of :func:`mx_fp8`'s output (codes `[n, >= ceil(hidden / 32)]` e8m0)."""
    n, h = q.shape
    scale = codes.view(torch.uint8)[:, : -(-h // 32)].view(E8M0).float()
    return (_blocks(q.float(), 32) * scale.unsqueeze(-1)).flatten(1)[:, :h]


@dataclasses.dataclass(frozen=True)
class Quant:
    """One dispatch quantization, the one type front-ends build: Ascend's ``mode`` 2 (:func:`per_token`), 3
    (:func:`per_group_fp8`), 4 (:func:`mx_fp8`, no smoothing) or 5 (:func:`mx_clip_fp8`) into ``dtype``, or with
    ``deepep`` DeepEP's fp8 (mode 3, e4m3 per 128 channels, :func:`scale_for_fp8_`'s scales; ``round_scale``: powers
    of two; ``ue8m0``: returned packed, :func:`pack_ue8m0`); calling it gives ``(q, scales)``."""

    mode: int
    dtype: torch.dtype
    deepep: bool = False
    round_scale: bool = False
    ue8m0: bool = False

    @property
    def scale_dtype(self) -> torch.dtype:
        return E8M0 if self.mode >= 4 else torch.float32

    def scale_shape(self, hidden: int) -> tuple[int, ...]:
        """Scales per row: `()` (mode 2), `[ceil(H / 128)]` (3), `[align2(ceil(H / 32))]` (4, 5)."""
        return {2: (), 3: (-(-hidden // 128),)}.get(self.mode, (-(-hidden // 64) * 2,))

    def scale_bytes(self, hidden: int) -> int:
        return math.prod(self.scale_shape(hidden)) * self.scale_dtype.itemsize

    def __call__(self, x: torch.Tensor, smooth: torch.Tensor | None = None) -> Quantized:
        if self.deepep:
            work = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            scale_inv = scale_for_fp8_(work, x, self.round_scale)
            return work.to(self.dtype), scale_inv
        if self.mode == 2:
            return per_token(x, smooth, self.dtype)
        if self.mode == 3:
            return per_group_fp8(x, smooth, self.dtype)
        return mx_fp8(x, self.dtype) if self.mode == 4 else mx_clip_fp8(x, self.dtype)


INT8_PER_TOKEN = Quant(2, torch.int8)  # DeepEP's use_fp8 with quant_format "int8_per_token" (Ascend's quant_mode 2)


@functools.cache
def deepep_fp8(round_scale: bool = False, ue8m0: bool = False) -> Quant:
    """DeepEP's fp8 (``use_fp8`` with ``round_scale`` / ``use_ue8m0``)."""
    return Quant(3, FP8_DTYPE, deepep=True, round_scale=round_scale, ue8m0=ue8m0)


def per_group_int8(x: torch.Tensor, group: int = 8) -> Quantized:
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
    return q.nan_to_num_(nan=0.0).clamp_(-127, 127).to(torch.int8).view(n, h), scale  # NaN: see the module doc


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


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales `[..., G]` (G % 4 == 0) to their exponent bytes packed as `[..., G // 4]` int32."""
    exponent = (scale_inv.contiguous().flatten().view(torch.int32) >> 23).to(torch.uint8)
    return exponent.view(torch.int32).view(*scale_inv.shape[:-1], scale_inv.shape[-1] // 4)
