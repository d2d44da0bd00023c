"""Quantization numerics shared by the ops, the Buffer and the tests.

All functions are pure and vectorized. Rounding is round-half-to-even (``torch.round``), as the NPU's ``rint``.
"""

from __future__ import annotations

import torch


def per_token_int8(x: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascend ``quant_mode=2``: per-token dynamic int8 with optional smoothing.

    ``xf = fp32(x) * smooth``; ``q = int8(rint(xf * (127 / amax)))``; ``scale = amax / 127``
    with ``amax = max |xf|`` over the row. A row of zeros gives ``q = 0`` and ``scale = 0`` (the NPU's result for
    ``amax = 0`` is not documented).

    Arguments:
        x: `[num_tokens, hidden]` with `torch.bfloat16`, `torch.float16` or `torch.float32`.
        smooth_scales: `[num_tokens, hidden]` or `[hidden]` with `torch.float32`, or None.

    Returns:
        q: `[num_tokens, hidden]` with `torch.int8`.
        scale: `[num_tokens]` with `torch.float32` (dequantize with ``q * scale[:, None]``).
    """
    xf = x.float()
    if smooth_scales is not None:
        xf = xf * smooth_scales
    amax = xf.abs().amax(dim=-1) if xf.shape[-1] > 0 else xf.new_zeros(xf.shape[:-1])
    # tensor / tensor on purpose: ``127.0 / amax`` is computed as ``reciprocal(amax) * 127`` by torch (and a scalar
    # divisor may become a reciprocal multiply on GPU), which is 1 ulp off the formula and flips rint at .5 ties.
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127 / torch.where(amax > 0, amax, c127), torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, amax / c127


def per_group_int8(x: torch.Tensor, group: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``comm_quant_mode=2``: int8 with one scale per ``group`` consecutive elements, scale kept in x's dtype.

    ``scale = to_dtype(amax_g / 127)``; ``q = int8(rint(x / scale))``; dequantize with ``q * scale``. Groups of
    zeros give scale 0 and q 0. ``hidden`` must be a multiple of ``group``.

    Arguments:
        x: `[num_tokens, hidden]` with `torch.bfloat16` or `torch.float16` (`torch.float32` allowed).

    Returns:
        q: `[num_tokens, hidden]` with `torch.int8`.
        scale: `[num_tokens, hidden // group]` with x's dtype.
    """
    n, h = x.shape
    xg = x.float().view(n, h // group, group)
    amax = xg.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, 127.0)).to(x.dtype)
    sf = scale.float().unsqueeze(-1)
    q = torch.where(sf > 0, torch.round(xg / torch.where(sf > 0, sf, torch.ones_like(sf))), torch.zeros_like(xg))
    return q.clamp_(-127, 127).to(torch.int8).view(n, h), scale


def dequant_per_group_int8(q: torch.Tensor, scale: torch.Tensor, group: int = 8) -> torch.Tensor:
    """Inverse of :func:`per_group_int8`, in fp32: `[num_tokens, hidden]` with `torch.float32`."""
    n, h = q.shape
    return (q.float().view(n, h // group, group) * scale.float().unsqueeze(-1)).view(n, h)
