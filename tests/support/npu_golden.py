"""Goldens shared by the torch_npu ports (``test_torch_npu_ported.py``) and the caller replays (``test_callers.py``).

Written from the documented formulas (the aclnn ``MoeDistributeDispatchV2`` / ``CombineV2`` docs and
torch_npu's, with its golden tests ``test/test_custom_ops/test_moe_distribute_*_v2.py``),
the way torch_npu's own golden tests compute them: routing is ``npu_moe_init_routing``'s stable sort of the flat
(token, slot) expert ids, quantization is recomputed per row with numpy / plain torch casts, and combine sums in fp32
over the top-k slots in ascending order, then casts once. Nothing here imports ``deep_ep_npu``.
"""

from __future__ import annotations

import numpy as np
import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # maxV of each quantized dtype
MX_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # exponent of the largest power of two below maxV


def init_routing(x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``npu_moe_init_routing`` (torch_npu's test L25-41): stable argsort of the flat `[N * K]` ids (ties keep flat
    order). Returns ``expanded_x`` `[N * K, H]` (row i = ``x[order[i] // K]``), the sorted ids `[N * K]` and ``order``
    `[N * K]` (the flat (token, slot) position of row i)."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    return x[order // k], flat[order], order


def occurrence_index(expert_ids: torch.Tensor) -> torch.Tensor:
    """`[Bs * K]` int32: for flat pair i, how many earlier flat pairs name the same expert (torch_npu's ``expand_idx``,
    ``calc_expand_idx`` of the A2 tests)."""
    seen: dict[int, int] = {}
    out = []
    for e in expert_ids.reshape(-1).tolist():
        out.append(seen.get(e, 0))
        seen[e] = seen.get(e, 0) + 1
    return torch.tensor(out, dtype=torch.int32)


def expert_ffn(rows: torch.Tensor, experts: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """The tests' 'expert': elementwise per row (so batching cannot change a bit), fp32 math, cast to ``dtype``.
    ``rows`` `[n, H]` (any float dtype), ``experts`` `[n]` global expert ids (or one int)."""
    e = torch.as_tensor(experts, dtype=torch.float32).reshape(-1, 1)
    return (rows.float() * (1.0 + e / 4.0) - e / 8.0).to(dtype)


def _f32(x: torch.Tensor, smooth: torch.Tensor | None) -> np.ndarray:
    xf = x.float().numpy().astype(np.float32)
    return xf if smooth is None else (xf * smooth.float().numpy().astype(np.float32)).astype(np.float32)


def _cast(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values clamped to +-maxV, then cast (int8: rint first; float8: the cast rounds to nearest even)."""
    v = np.clip(values.astype(np.float32), -QMAX[dtype], QMAX[dtype])
    if dtype == torch.int8:
        return torch.from_numpy(np.rint(v).astype(np.int8))
    return torch.from_numpy(v).to(dtype)


def quant_per_token(row: torch.Tensor, smooth: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """quant_mode 2 of one row `[H]`: ``xf = x * smooth``, ``q = rint(xf * (maxV / amax))``, scale ``amax / maxV``
    (fp32 true divisions; an all-zero row gives q 0, scale 0). Returns q `[H]` ``dtype`` and the scale."""
    xf = _f32(row, smooth)
    amax = np.float32(np.abs(xf).max())
    if amax == 0:
        return torch.zeros(xf.shape, dtype=dtype), 0.0
    vmax = np.float32(QMAX[dtype])
    return _cast(xf * np.float32(vmax / amax), dtype), float(np.float32(amax / vmax))


def quant_per_group(
    row: torch.Tensor, smooth: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_mode 3 of one row `[H]`: per 128 channels ``scale_g = amax_g / maxV``, ``q = cast(xf / scale_g)``. Returns
    q `[H]` ``dtype`` and the scales `[ceil(H / 128)]` fp32."""
    xf = _f32(row, smooth)
    q, scales = np.zeros_like(xf), []
    for lo in range(0, xf.size, 128):
        g = xf[lo : lo + 128]
        scale = np.float32(np.float32(np.abs(g).max()) / np.float32(QMAX[dtype]))
        q[lo : lo + 128] = (g / scale).astype(np.float32) if scale > 0 else 0.0
        scales.append(scale)
    return _cast(q, dtype), torch.tensor(scales, dtype=torch.float32)


def quant_mx(row: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_mode 4 (MX) of one row `[H]`: per 32 elements the e8m0 code ``c = max(floor(log2 amax) + 127 - emax, 0)``
    (0 for a zero block), elements ``cast(x / 2^(c - 127))``. Returns q `[H]` ``dtype`` and the codes
    `[align2(ceil(H / 32))]` uint8 (the padding entry 0)."""
    xf = _f32(row, None)
    q, codes = np.zeros_like(xf), []
    for lo in range(0, xf.size, 32):
        g = xf[lo : lo + 32]
        amax = float(np.abs(g).max())
        code = 0 if amax == 0 else max(int(np.frexp(amax)[1]) - 1 + 127 - MX_EMAX[dtype], 0)
        q[lo : lo + 32] = g / np.float32(2.0 ** (code - 127))
        codes.append(code)
    codes += [0] * (len(codes) % 2)
    return _cast(q, dtype), torch.tensor(codes, dtype=torch.uint8)


def mx_dequant(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`[n, H]` fp32 ``q * 2^(c - 127)`` per 32-element block (codes `[n, >= ceil(H / 32)]`, uint8 or e8m0)."""
    c = codes.view(torch.uint8).long()
    scale = torch.pow(2.0, (c[:, : -(-q.shape[1] // 32)] - 127).double()).float()
    return q.float() * scale.repeat_interleave(32, dim=1)[:, : q.shape[1]]


def weighted_sum(parts: list[tuple[float, torch.Tensor]], hidden: int) -> torch.Tensor:
    """``sum w * y`` in fp32, in the order given (top-k slots ascending, then weight-1 terms); `[H]` fp32."""
    acc = torch.zeros(hidden, dtype=torch.float32)
    for w, y in parts:
        acc += torch.tensor(w, dtype=torch.float32) * y.float()
    return acc
