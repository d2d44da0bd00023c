"""A decode batch's attention over the paged KV cache on the CPU (``attention.c``): one call per layer writes the step's
keys / values to their cache slots and attends every sequence's cached keys in place (no gathered copy of the cache,
no mask tensor)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import library

_CODES = {torch.bfloat16: 1, torch.float32: 0}


def decode_attention(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    block_table: Tensor,
    positions: Tensor,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor | None:
    """Write each sequence's key and value at its cache slot, then its query's attention over its keys at positions
    ``0 .. positions[s]`` (with ``window``: the last ``window`` of them), scores and softmax in fp32 (``sinks``: a
    logit per head joins each softmax denominator). None where the kernel does not apply (not contiguous bf16 / fp32
    CPU tensors, kernels off or not built), having done nothing.

    Arguments:
        qkv: `[S, W]` bf16 or fp32, contiguous: per row (sequence), q `[num_heads, head_dim]`, k and v `[num_kv_heads,
            head_dim]` side by side from column 0 (``W >= (num_heads + 2 num_kv_heads) head_dim``).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, dtype of `qkv`, contiguous.
        slots: `[S]` `torch.int64`, each sequence's new cache slot (``block * block_size + offset``).
        block_table: `[S, max_blocks]` `torch.int64`, each sequence's blocks.
        positions: `[S]` `torch.int64`, each query's position (its key's too).
        sinks: `[num_heads]` `torch.float32`, or None.

    Returns:
        `[S, num_heads * head_dim]`, dtype of `qkv`.
    """
    code = _CODES.get(qkv.dtype)
    tensors = (qkv, k_cache, v_cache, slots, block_table, positions)
    if code is None or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype or qkv.dim() != 2:
        return None
    if not all(t.is_cpu and t.is_contiguous() for t in tensors) or (lib := library()) is None:
        return None
    s = qkv.shape[0]
    out = qkv.new_empty(s, num_heads * head_dim)
    lib.decode_attention(
        code,
        qkv,
        qkv.shape[1],
        s,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache,
        v_cache,
        slots,
        block_table,
        block_table.shape[1],
        k_cache.shape[1],
        positions,
        window or 0,
        None if sinks is None else sinks.float().contiguous(),
        float(scale),
        out,
    )
    return out
