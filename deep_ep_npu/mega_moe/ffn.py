"""The expert FFN of the fused MegaMoE, as an exact numeric spec (GMM1 -> SwiGLU -> GMM2).

int8 weights (``w1_scale`` / ``w2_scale`` given), for the rows ``x`` of one local expert:

```
q1, s1 = per_token_int8(x)                    # dispatch quant_mode 2: rint(x * 127 / amax), s1 = amax / 127
h      = fp32(int(q1) @ int(w1) * s1[t] * w1_scale[c])   # int32-exact accumulate, dequant in fp64, one fp32 round
g      = silu(h[:, :N]) * h[:, N:]            # SwiGLU: w1's last dim is gate then up; fp32
q2, s2 = per_token_int8(g)                    # dynamic int8 quant of the SwiGLU output
y      = out_dtype(fp32(int(q2) @ int(w2) * s2[t] * w2_scale[c]))
```

Float weights (bf16 / fp16 / fp32, no scales): ``h = fp32(x) @ fp32(w1)``; ``g = silu(gate) * up``;
``y = out_dtype(g @ fp32(w2))``.

The integer products are exact: int8 values summed over ``K`` stay far below 2^53, so an fp64 matmul (BLAS-fast
on CPU) returns the exact int32 accumulator the NPU's cube unit produces; for inner sizes <= 1040 every partial sum
stays below 2^24 and the (faster) fp32 matmul is exact as well. Known differences to the A5 kernel of the
seed: it rounds GMM1's output to fp16 (``gmC``) before SwiGLU where this spec keeps fp32, and its doc writes
``SiLU(up) * gate`` where the issue and every serving model use ``silu(gate) * up`` (kept here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import per_token_int8

FP32_EXACT_INNER = (1 << 24) // (127 * 127)
"""Inner sizes up to this keep every int8 partial sum below 2^24, so an fp32 matmul is exact too (and faster)."""


def int8_gmm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact integer matmul of int8 operands.

    Arguments:
        q: `[num_rows, k]` with `torch.int8`.
        w: `[k, m]` with `torch.int8`.

    Returns:
        acc: `[num_rows, m]` with `torch.float64`, holding the exact integer sums (the int32 accumulator).
    """
    if q.shape[1] <= FP32_EXACT_INNER:
        return (q.float() @ w.float()).double()
    return q.double() @ w.double()


def dequant(acc: torch.Tensor, token_scale: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """``fp32(acc * token_scale[t] * channel_scale[c])``, evaluated left to right in fp64.

    Arguments:
        acc: `[num_rows, m]` with `torch.float64` (exact integers).
        token_scale: `[num_rows]` with `torch.float32`.
        channel_scale: `[m]` with `torch.float32`.

    Returns:
        `[num_rows, m]` with `torch.float32`.
    """
    return (acc * token_scale.double().unsqueeze(1) * channel_scale.double().unsqueeze(0)).float()


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of `[num_rows, 2N]` `torch.float32` (gate first); returns `[num_rows, N]` fp32."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def int8_expert_ffn(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One expert's int8 FFN on already-quantized rows (see the module docstring for the formula).

    Arguments:
        q: `[num_rows, hidden]` with `torch.int8`; q_scale: `[num_rows]` with `torch.float32` (per-token scales).
        w1: `[hidden, 2N]` with `torch.int8`; w1_scale: `[2N]` with `torch.float32`.
        w2: `[N, hidden]` with `torch.int8`; w2_scale: `[hidden]` with `torch.float32`.

    Returns:
        y: `[num_rows, hidden]` with ``out_dtype``.
    """
    h = dequant(int8_gmm(q, w1), q_scale, w1_scale)
    q2, s2 = per_token_int8(swiglu(h))
    return dequant(int8_gmm(q2, w2), s2, w2_scale).to(out_dtype)


def float_expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One expert's float FFN: ``out_dtype(swiglu(fp32(x) @ fp32(w1)) @ fp32(w2))``.

    Arguments:
        x: `[num_rows, hidden]` with `torch.bfloat16` / `torch.float16` / `torch.float32`.
        w1: `[hidden, 2N]`, w2: `[N, hidden]`, same float dtypes.

    Returns:
        y: `[num_rows, hidden]` with ``out_dtype``.
    """
    return (swiglu(x.float() @ w1.float()) @ w2.float()).to(out_dtype)


def grouped_ffn(
    expand_x: torch.Tensor,
    dynamic_scales: torch.Tensor,
    expert_token_nums: torch.Tensor,
    experts: range,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """GMM1 -> SwiGLU -> GMM2 over dispatch's expert-major rows, for the local experts in ``experts``.

    Arguments:
        expand_x: `[A, hidden]` dispatch output (`torch.int8` for int8 weights), rows expert-major.
        dynamic_scales: `[A]` with `torch.float32` (used for int8 weights).
        expert_token_nums: `[num_local_experts]` with `torch.int64`, rows per local expert (counts).
        experts: the local experts that may have rows (the others must have zero rows).
        w1: `[num_local_experts, hidden, 2N]`; w2: `[num_local_experts, N, hidden]`.
        w1_scale: `[num_local_experts, 2N]` / w2_scale: `[num_local_experts, hidden]` `torch.float32`, or None.

    Returns:
        y: `[num_rows, hidden]` with ``out_dtype``, row-aligned with ``expand_x[:num_rows]``.
    """
    counts = expert_token_nums.tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    y = torch.empty((starts[-1], expand_x.shape[1]), dtype=out_dtype, device=expand_x.device)
    for e in experts:
        lo, hi = starts[e], starts[e + 1]
        if hi == lo:
            continue
        if w1_scale is not None and w2_scale is not None:
            y[lo:hi] = int8_expert_ffn(
                expand_x[lo:hi], dynamic_scales[lo:hi], w1[e], w1_scale[e], w2[e], w2_scale[e], out_dtype
            )
        else:
            y[lo:hi] = float_expert_ffn(expand_x[lo:hi], w1[e], w2[e], out_dtype)
    return y
