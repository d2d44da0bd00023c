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
stays below 2^24 and the (faster) fp32 matmul is exact as well. Known differences to the A5 PTO MegaMoE kernel: it
rounds GMM1's output to fp16 (``gmC``) before SwiGLU where this spec keeps fp32, and its doc writes
``SiLU(up) * gate`` where serving models use ``silu(gate) * up`` (kept here).
"""

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import per_token_int8

FP32_EXACT_INNER = (1 << 24) // (127 * 127)  # inner sizes keeping every int8 partial sum below 2^24 (fp32 exact)


def int8_gmm(q: Tensor, w: Tensor) -> Tensor:
    """Exact integer matmul of int8 `[rows, k]` by int8 `[k, m]`: `[rows, m]` `torch.float64` integer sums."""
    return (q.float() @ w.float()).double() if q.shape[1] <= FP32_EXACT_INNER else q.double() @ w.double()


def dequant(acc: Tensor, token_scale: Tensor, channel_scale: Tensor) -> Tensor:
    """``fp32(acc * token_scale[t] * channel_scale[c])``, evaluated left to right in fp64: ``acc`` `[rows, m]`
    `torch.float64`, ``token_scale`` `[rows]` / ``channel_scale`` `[m]` `torch.float32`; returns `[rows, m]` fp32."""
    return (acc * token_scale.double().unsqueeze(1) * channel_scale.double().unsqueeze(0)).float()


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of `[num_rows, 2N]` `torch.float32` (gate first); returns `[num_rows, N]` fp32."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def int8_expert_ffn(q: Tensor, q_scale: Tensor, w1: Tensor, w1_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                    out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    """One expert's int8 FFN on already-quantized rows (the module docstring's formula): q `[num_rows, hidden]`
    `torch.int8` with per-token scales q_scale `[num_rows]` `torch.float32`; w1 `[hidden, 2N]` / w2 `[N, hidden]`
    `torch.int8`; w1_scale `[2N]` / w2_scale `[hidden]` `torch.float32`. Returns y `[num_rows, hidden]` out_dtype."""
    h = dequant(int8_gmm(q, w1), q_scale, w1_scale)
    q2, s2 = per_token_int8(swiglu(h))
    return dequant(int8_gmm(q2, w2), s2, w2_scale).to(out_dtype)


def float_expert_ffn(x: Tensor, w1: Tensor, w2: Tensor, out_dtype: torch.dtype) -> Tensor:
    """One expert's float FFN, ``out_dtype(swiglu(fp32(x) @ fp32(w1)) @ fp32(w2))``: x `[num_rows, hidden]`, w1
    `[hidden, 2N]`, w2 `[N, hidden]` (each bf16 / fp16 / fp32); returns y `[num_rows, hidden]` with ``out_dtype``."""
    return (swiglu(x.float() @ w1.float()) @ w2.float()).to(out_dtype)


def grouped_ffn(expand_x: Tensor, dynamic_scales: Tensor, expert_token_nums: Tensor, experts: range, w1: Tensor,
                w2: Tensor, w1_scale: Tensor | None, w2_scale: Tensor | None,
                out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    """GMM1 -> SwiGLU -> GMM2 over dispatch's expert-major rows for the local experts in ``experts`` (the others must
    have zero rows); returns y `[num_rows, hidden]` with ``out_dtype``, row-aligned with ``expand_x[:num_rows]``.
    expand_x `[A, hidden]` (`torch.int8` for int8 weights), dynamic_scales `[A]` `torch.float32` (int8 weights),
    expert_token_nums `[L]` `torch.int64` rows per local expert, w1 `[L, hidden, 2N]`, w2 `[L, N, hidden]`, w1_scale
    `[L, 2N]` / w2_scale `[L, hidden]` `torch.float32` or None (L = num_local_experts)."""
    starts = [0, *itertools.accumulate(expert_token_nums.tolist())]
    y = torch.empty((starts[-1], expand_x.shape[1]), dtype=out_dtype, device=expand_x.device)
    for e in experts:
        lo, hi = starts[e], starts[e + 1]
        x = expand_x[lo:hi]
        if hi > lo and w1_scale is not None and w2_scale is not None:
            y[lo:hi] = int8_expert_ffn(x, dynamic_scales[lo:hi], w1[e], w1_scale[e], w2[e], w2_scale[e], out_dtype)
        elif hi > lo:
            y[lo:hi] = float_expert_ffn(x, w1[e], w2[e], out_dtype)
    return y
