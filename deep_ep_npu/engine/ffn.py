"""The expert FFN of the fused MegaMoE, as an exact numeric spec (GMM1 -> SwiGLU -> GMM2; ``docs/mega-moe.md``).

int8 weights (``w1_scale`` / ``w2_scale`` given), for the rows ``x`` of one local expert:

```
q1, s1 = per_token_int8(x)                    # dispatch quant_mode 2: rint(x * 127 / amax), s1 = amax / 127
c1     = fp16(fp32(int(q1) @ int(w1) * w1_scale[c]))  # GMM1: int32-exact accumulate, Fixpipe channel dequant -> gmC
h      = fp32(c1) * s1[t]                     # SwiGLU stage: the per-token scale, in fp32
gate, up = h[:, :N], h[:, N:]                 # w1's 2N output columns: gate first, then up
gate, up = min(gate, L), clamp(up, -L, L)     # only when swiglu_limit L > 0
g      = silu(gate) * up                      # fp32
q2, s2 = per_token_int8(g)                    # dynamic int8 quant of the SwiGLU output
c2     = fp16(fp32(int(q2) @ int(w2) * w2_scale[c]))  # GMM2, Fixpipe channel dequant -> the fp16 CV tile
y      = out_dtype(fp32(c2) * s2[t])          # Combine: per-token scale in fp32, one rounding to out_dtype
```

Float weights (``wd`` = their dtype): ``h = wd(fp32(x) @ fp32(w1))``, ``g = wd(silu(gate) * up)``,
``y = out_dtype(fp32(g) @ fp32(w2))``. The rounding points are the PTO MegaMoE seed's and vllm-ascend's
``dispatch_ffn_combine`` kernel's; unconfirmed without an NPU: how the Fixpipe rounds ``acc * scale`` (here: fp64
product, then fp32, then fp16)."""

import dataclasses
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant import mx_dequant, mx_fp8, per_token_int8

FP32_EXACT_INNER = (1 << 24) // (127 * 127)  # inner sizes keeping every int8 partial sum below 2^24 (fp32 exact)


def int8_gmm(q: Tensor, w: Tensor, channel_scale: Tensor) -> Tensor:
    """A GMM's Fixpipe output ``fp16(fp32(acc * channel_scale[c]))`` (product in fp64) of the exact integer sums
    ``acc = q @ w``: int8 q `[rows, k]` and w `[k, m]`, ``channel_scale`` `[m]` fp32; returns `[rows, m]` fp16."""
    acc = (q.float() @ w.float()).double() if q.shape[1] <= FP32_EXACT_INNER else q.double() @ w.double()
    return (acc * channel_scale.double().unsqueeze(0)).float().half()


@dataclasses.dataclass(frozen=True)
class Activation:
    """A gated activation of CANN's ``mega_moe`` on `[num_rows, 2N]` fp32 ``h`` (G = gate, the first N, U = up; c =
    ``clamp``, +inf when 0; ``G_c = min(G, c)``, ``U_c = clip(U, -c, c)``): ``swiglu`` ``silu(G_c) * U_c``;
    ``swiglustep`` ``min(silu(G), c) * U_c``; ``swigluoai`` ``G_c * sigmoid(alpha * G_c) * (U_c + beta)``;
    ``situglu`` ``beta * tanh(G / beta) * sigmoid(G) * L(U)``, ``L(U) = U`` or ``linear_beta * tanh(U /
    linear_beta)`` (clamp unused). Returns `[num_rows, N]` fp32."""

    name: str = "swiglu"
    clamp: float = 0.0
    alpha: float = 1.702
    beta: float = 1.0
    linear_beta: float | None = None
    requant: torch.dtype | None = None  # Ascend 950's MX weights: the output MX-quantized to this float8 and back

    def __call__(self, h: Tensor) -> Tensor:
        out = self._gated(h)
        return out if self.requant is None else mx_dequant(*mx_fp8(out, self.requant))

    def _gated(self, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        c = self.clamp or float("inf")
        g_c, u_c = gate.clamp(max=c), up.clamp(min=-c, max=c)
        if self.name == "swiglu":
            return F.silu(g_c) * u_c
        if self.name == "swiglustep":
            return F.silu(gate).clamp(max=c) * u_c
        if self.name == "swigluoai":
            return g_c * torch.sigmoid(self.alpha * g_c) * (u_c + self.beta)
        lin = up if self.linear_beta is None else self.linear_beta * torch.tanh(up / self.linear_beta)
        return self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate) * lin


Limit = float | Callable[[Tensor], Tensor]  # a SwiGLU clamp (0: none) or an activation such as :class:`Activation`


def swiglu(h: Tensor, limit: Limit = 0.0) -> Tensor:
    """``silu(gate) * up`` of `[num_rows, 2N]` `torch.float32` (gate first), with ``gate <= limit`` and
    ``|up| <= limit`` when ``limit > 0``; an :class:`Activation` instead of ``limit`` applies it. Returns
    `[num_rows, N]` fp32."""
    if callable(limit):
        return limit(h)
    gate, up = h.chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def int8_expert_ffn(
    q: Tensor,
    q_scale: Tensor,
    w1: Tensor,
    w1_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    out_dtype: torch.dtype,
    swiglu_limit: Limit = 0.0,
) -> Tensor:
    """One expert's int8 FFN on already-quantized rows (the module docstring's formula): q `[num_rows, hidden]`
    `torch.int8` with per-token scales q_scale `[num_rows]` `torch.float32`; w1 `[hidden, 2N]` / w2 `[N, hidden]`
    `torch.int8`; w1_scale `[2N]` / w2_scale `[hidden]` `torch.float32`. Returns y `[num_rows, hidden]` out_dtype."""
    h = int8_gmm(q, w1, w1_scale).float() * q_scale.unsqueeze(1)
    q2, s2 = per_token_int8(swiglu(h, swiglu_limit))
    return (int8_gmm(q2, w2, w2_scale).float() * s2.unsqueeze(1)).to(out_dtype)


def float_expert_ffn(x: Tensor, w1: Tensor, w2: Tensor, out_dtype: torch.dtype, swiglu_limit: Limit = 0.0) -> Tensor:
    """One expert's float FFN (the module docstring's formula, GMM1 and SwiGLU outputs rounded to the weights'
    dtype): x `[num_rows, hidden]`, w1 `[hidden, 2N]`, w2 `[N, hidden]` (each bf16 / fp16 / fp32); returns y
    `[num_rows, hidden]` with ``out_dtype``."""
    wd = w1.dtype
    h = (x.float() @ w1.float()).to(wd).float()
    return (swiglu(h, swiglu_limit).to(wd).float() @ w2.float()).to(out_dtype)


def grouped_ffn(
    expand_x: Tensor,
    dynamic_scales: Tensor,
    expert_token_nums: Tensor,
    experts: range,
    w1: Tensor,
    w2: Tensor,
    w1_scale: Tensor | None,
    w2_scale: Tensor | None,
    out_dtype: torch.dtype,
    swiglu_limit: Limit = 0.0,
) -> Tensor:
    """GMM1 -> SwiGLU -> GMM2 over dispatch's expert-major rows for the local experts in ``experts`` (the others must
    have zero rows); returns y `[num_rows, hidden]` with ``out_dtype``, row-aligned with ``expand_x[:num_rows]``.
    expand_x `[A, hidden]` (`torch.int8` for int8 weights), dynamic_scales `[A]` `torch.float32` (int8 weights),
    expert_token_nums `[L]` `torch.int64` rows per local expert, w1 `[L, hidden, 2N]`, w2 `[L, N, hidden]`, w1_scale
    `[L, 2N]` / w2_scale `[L, hidden]` `torch.float32` or None (L = num_local_experts); swiglu_limit > 0 clamps."""
    starts = [0, *itertools.accumulate(expert_token_nums.tolist())]
    y = torch.empty((starts[-1], expand_x.shape[1]), dtype=out_dtype, device=expand_x.device)
    for e in experts:
        rows = slice(starts[e], starts[e + 1])
        if rows.stop > rows.start and w1_scale is not None and w2_scale is not None:
            x, q_scale = expand_x[rows], dynamic_scales[rows]
            y[rows] = int8_expert_ffn(x, q_scale, w1[e], w1_scale[e], w2[e], w2_scale[e], out_dtype, swiglu_limit)
        elif rows.stop > rows.start:
            y[rows] = float_expert_ffn(expand_x[rows], w1[e], w2[e], out_dtype, swiglu_limit)
    return y
