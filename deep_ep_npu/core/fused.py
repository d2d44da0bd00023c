"""A fused call's rules (MegaMoE: :func:`deep_ep_npu.mega_moe.mega_moe`, ``Buffer.mega_moe``, CANN's ``mega_moe``):
its expert FFN (:class:`.call.FFN`) and its tokens, with :mod:`.rules`' primitives."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import invalid, shape
from . import rules
from .call import FFN, Experts


def ffn(f: FFN, x: torch.Tensor, num_local: int, topk: int, num_max: int, world_size: int) -> FFN:
    """The expert FFN of a fused call on ``x`` `[M, K]` (E_local = ``num_local``); see :class:`.call.FFN`."""
    hidden, num_tokens = x.shape[1], x.shape[0]
    limit = 0.0 if f.swiglu_limit is None else f.swiglu_limit
    fp32_max = torch.finfo(torch.float32).max  # swiglu_limit is the fused op's fp32 attribute (or an Activation)
    if callable(limit):  # an engine.ffn.Activation (CANN's mega_moe)
        pass
    elif isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit <= fp32_max:
        allowed = f"allowed None or a float in [0, {fp32_max:.4g}] (0: no clamp)"
        raise invalid("swiglu_limit", f"got {f.swiglu_limit!r}, {allowed}")
    if (f.w1_scale is None) != (f.w2_scale is None):
        both = "w1_scale and w2_scale must be given together (int8 weights) or both be None (float weights)"
        raise invalid("w2_scale" if f.w2_scale is None else "w1_scale", both)
    int8 = f.w1_scale is not None
    wdt = (torch.int8,) if int8 else rules.ACT_DTYPES
    why = "int8 because scales are given" if int8 else "bf16/fp16/fp32 (int8 needs w1_scale and w2_scale)"
    for name, w in (("w1", f.w1), ("w2", f.w2)):
        if isinstance(w, torch.Tensor) and w.dtype not in wdt:
            raise invalid(name, f"dtype {w.dtype} not allowed here; must be {why}")
    w1, w2 = rules.tensor(f.w1, "w1", wdt, 3), rules.tensor(f.w2, "w2", wdt, 3)
    if tuple(w1.shape[:2]) != (num_local, hidden) or w1.shape[2] % 2 or w1.shape[2] == 0:
        want = f"[E_local = {num_local}, K = {hidden}, 2N] (gate then up, 2N > 0)"
        raise shape("w1", f"shape {tuple(w1.shape)} must be {want}")
    n = w1.shape[2] // 2
    rules.dims(w2, "w2", (num_local, n, hidden), "[E_local, N, K]")
    if w1.dtype != w2.dtype:
        raise invalid("w2", f"dtype {w2.dtype} differs from w1's {w1.dtype}")
    scales = (("w1_scale", f.w1_scale, 2 * n, "[E_local, 2N]"), ("w2_scale", f.w2_scale, hidden, "[E_local, K]"))
    for name, s, cols, what in scales if int8 else ():
        rules.dims(rules.tensor(s, name, (torch.float32,), 2), name, (num_local, cols), what)
    out_dtype = x.dtype if f.out_dtype is None else f.out_dtype
    rules.one_of(out_dtype, "out_dtype", (torch.float16, torch.bfloat16, torch.float32))
    max_output = num_max * topk * world_size if f.max_output_size is None else f.max_output_size
    rules.in_range(max_output, "max_output_size", 0, 1 << 40)
    if max_output < num_tokens * topk:
        why = "the routed-row workspace must hold every (token, expert) pair of this rank"
        raise shape("max_output_size", f"{max_output} < M * topK = {num_tokens} * {topk}; {why}")
    rules.one_of(f.segment_by, "segment_by", ("expert", "token"))
    most = num_local if f.segment_by == "expert" else num_max
    segments = min(most, 2) if f.num_segments is None else f.num_segments  # 2: measured best on the CPU reference
    rules.in_range(segments, "num_segments", 1, most)
    limit = limit if callable(limit) else float(limit)
    return dataclasses.replace(
        f, w1=w1, w2=w2, out_dtype=out_dtype, swiglu_limit=limit, num_segments=segments, max_output_size=max_output
    )


def tokens(
    x: object, topk_idx: object, topk_weights: object, x_active_mask: object, num_max: int, e: Experts
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A fused call's tokens: x `[M, K]`, topk_idx `[M, topK]` (ids of the active rows checked; -1 kept, and -1 in
    every row outside the mask, whose weights are 0), topk_weights `[M, topK]` fp32, x_active_mask `[M]` (a prefix)."""
    x = rules.activations(x)
    if (m := x.shape[0]) > num_max:
        raise shape("x", f"has {m} tokens, more than num_max_dispatch_tokens_per_rank = {num_max}")
    mask = rules.optional_tensor(x_active_mask, "x_active_mask", (torch.bool,), 1)
    if mask is not None:
        if mask.shape[0] != m:
            raise shape("x_active_mask", f"has {mask.shape[0]} entries; must have M = {m} (one per token)")
        mask = mask.to(x.device)
        rules.prefix_mask(mask, m)
    ids = rules.tensor(topk_idx, "topk_idx", rules.ID_DTYPES, 2)
    if ids.shape[0] != m:
        raise shape("topk_idx", f"has {ids.shape[0]} rows but x has {m} tokens")
    active = None if mask is None else mask.unsqueeze(1).expand(ids.shape)
    # rows outside the mask may hold anything: they route nowhere (-1) and weigh 0
    idx = rules.expert_ids(ids, "topk_idx", e.num_moe_experts, m, rules.MAX_TOPK, True, active=active).long()
    weights = rules.tensor(topk_weights, "topk_weights", (torch.float32,), 2)
    rules.dims(weights, "topk_weights", (m, ids.shape[1]), "(M, topK)")
    return x, idx, weights if active is None else weights.masked_fill(~active, 0.0), mask
