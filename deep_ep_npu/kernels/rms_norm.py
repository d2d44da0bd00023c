"""RMSNorm of bf16 rows on the CPU (``rms_norm.c``), as transformers computes it, in one call instead of eight torch
ops (a decode step normalises ~17 times)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import library


def rms_norm(x: Tensor, weight: Tensor, eps: float, round_first: bool = True) -> Tensor | None:
    """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` in fp32, the product with ``weight`` taken after rounding the
    normalised row to bf16 (``round_first``: HF's ``weight * x.to(bf16)``, a bf16 weight) or before (gpt-oss), each
    result rounded once to bf16. Equal to those torch ops but for the order of the sum of squares (a row's mean may
    move in its last fp32 bits). None where the kernel does not apply (not contiguous bf16 CPU rows, kernels off or
    not built), having done nothing.

    Arguments:
        x: `[..., H]` `torch.bfloat16`, contiguous.
        weight: `[H]` `torch.bfloat16` (or, without ``round_first``, `torch.float32`), contiguous.

    Returns:
        `[..., H]` `torch.bfloat16`.
    """
    if not _applies(x, weight, round_first) or (lib := library()) is None:
        return None
    y, h = torch.empty_like(x), weight.shape[0]
    fp32 = int(weight.dtype == torch.float32)
    lib.rms_norm(x, x.numel() // h if h else 0, h, weight, fp32, int(round_first), float(eps), y)
    return y


def _applies(x: Tensor, weight: Tensor, round_first: bool) -> bool:
    """Whether ``x`` and ``weight`` are what the kernel takes (see :func:`rms_norm`)."""
    wants = (torch.bfloat16,) if round_first else (torch.bfloat16, torch.float32)
    if x.dtype != torch.bfloat16 or weight.dtype not in wants or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        return False
    return x.is_cpu and weight.is_cpu and x.is_contiguous() and weight.is_contiguous()


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float, round_first: bool = True) -> Tensor | None:
    """``x += delta`` in place (each sum rounded to bf16, as torch's ``x + delta``), then :func:`rms_norm` of the new
    ``x``: a decoder layer's residual add and the next norm in one call. None where the kernel does not apply (as
    :func:`rms_norm`; ``delta`` too must be contiguous bf16 of ``x``'s shape), having done nothing.

    Arguments:
        x: `[..., H]` `torch.bfloat16`, contiguous (updated).
        delta: `[..., H]` `torch.bfloat16`, contiguous.
        weight: `[H]`, as :func:`rms_norm`'s.

    Returns:
        `[..., H]` `torch.bfloat16`.
    """
    if delta.dtype != torch.bfloat16 or delta.shape != x.shape or not (delta.is_cpu and delta.is_contiguous()):
        return None
    if not _applies(x, weight, round_first) or (lib := library()) is None:
        return None
    y, h = torch.empty_like(x), weight.shape[0]
    lib.add_rms_norm(
        x,
        delta,
        x.numel() // h if h else 0,
        h,
        weight,
        int(weight.dtype == torch.float32),
        int(round_first),
        float(eps),
        y,
    )
    return y
