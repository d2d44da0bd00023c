"""The q / k heads of a fused q|k|v projection on the CPU (``rope.c``): their per-head RMSNorm (if any) and rotary
embedding, in place, in one call per layer instead of ~20 torch ops."""

from __future__ import annotations

import torch
from torch import Tensor

from . import library

_CODES = {torch.bfloat16: 1, torch.float32: 0}


def qk_norm_rope(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: Tensor,
    sin: Tensor,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float = 1e-6,
) -> bool:
    """In ``qkv``, each q head (columns ``h * head_dim``, h < ``num_heads``) and k head (the ``num_kv_heads`` after):
    RMSNorm over ``head_dim`` with ``q_weight`` / ``k_weight`` (both or neither; bf16: as
    :func:`~deep_ep_npu.kernels.rms_norm.rms_norm`), then ``x * cos + rotate_half(x) * sin`` on its first
    ``cos.shape[-1]`` dims, each op rounded to the dtype as torch's, so bf16 results equal the torch code's. False
    where the kernel does not apply (not contiguous bf16 / fp32 CPU tensors of one dtype, kernels off or not built,
    ``head_dim`` > 1024), having done nothing.

    Arguments:
        qkv: `[T, W]` bf16 or fp32, contiguous, ``W >= (num_heads + num_kv_heads) head_dim``.
        cos, sin: `[T, rd]` (``rd`` even, at most ``head_dim``), dtype of `qkv`, contiguous.
        q_weight, k_weight: `[head_dim]`, dtype of `qkv`, or None.
    """
    code = _CODES.get(qkv.dtype)
    weights = [w for w in (q_weight, k_weight) if w is not None]
    tensors = (qkv, cos, sin, *weights)
    if code is None or qkv.dim() != 2 or head_dim > 1024 or any(t.dtype != qkv.dtype for t in tensors):
        return False
    if not all(t.is_cpu and t.is_contiguous() for t in tensors) or (lib := library()) is None:
        return False
    lib.qk_norm_rope(
        code,
        qkv,
        qkv.shape[0],
        qkv.shape[1],
        num_heads,
        num_kv_heads,
        head_dim,
        q_weight,
        k_weight,
        float(eps),
        cos,
        sin,
        cos.shape[-1],
    )
    return True
