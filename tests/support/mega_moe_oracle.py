"""The independent single-process oracle of the fused MegaMoE tests (imports nothing from deep_ep_npu).

``out[t] = sum_k p[t,k] * FFN_e(x[t])`` recomputed token by token from the documented formula (the fused kernel's
rounding points: int8 GMM outputs in fp16 after the channel scale, the token scale applied in fp32 after that; float
weights: GMM1 and SwiGLU outputs rounded to the weights' dtype; the swiglu_limit clamp), with its own quantization
(numpy, round half to even), int64 integer matmuls and per-token loops. Tokens outside a rank's active prefix
(``Case.active``) contribute a zero row whatever their ids, weights and x hold.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Case:
    """Every rank's inputs and every expert's weights (global expert e lives on rank e // num_local)."""

    xs: list[torch.Tensor]
    idx: list[torch.Tensor]
    probs: list[torch.Tensor]
    w1: torch.Tensor  # [E, K, 2N]
    w2: torch.Tensor  # [E, N, K]
    s1: torch.Tensor | None  # [E, 2N]
    s2: torch.Tensor | None  # [E, K]
    num_local: int
    num_max: int
    active: list[int] | None = None  # per rank: the active prefix length (x_active_mask); None: all active
    swiglu_limit: float = 0.0

    def mask(self, r: int) -> torch.Tensor | None:
        """Rank r's x_active_mask `[M]` bool, or None."""
        if self.active is None:
            return None
        return torch.arange(self.xs[r].shape[0]) < self.active[r]

    def rank_args(self, r: int) -> tuple:
        sl = slice(r * self.num_local, (r + 1) * self.num_local)
        s1 = None if self.s1 is None else self.s1[sl]
        s2 = None if self.s2 is None else self.s2[sl]
        return self.xs[r], self.idx[r], self.probs[r], self.w1[sl], self.w2[sl], s1, s2

    def keywords(self, r: int, world_size: int) -> dict:
        """Rank ``r``'s keywords of a mega_moe call: the weights' scales, the token bound and the expert count."""
        *_, s1, s2 = self.rank_args(r)
        num_experts = self.num_local * world_size
        return dict(w1_scale=s1, w2_scale=s2, num_max_dispatch_tokens_per_rank=self.num_max, num_experts=num_experts)


def make_case(
    seed,
    tokens,
    hidden,
    n,
    topk,
    num_local,
    *,
    int8=True,
    x_dtype=torch.bfloat16,
    holes=0.0,
    inactive=None,
    swiglu_limit=0.0,
) -> Case:
    """Random inputs; ``inactive`` (per rank): that many trailing tokens are outside the mask and get garbage ids
    (out of range, negative, repeated), NaN weights and NaN / inf activations."""
    g = torch.Generator().manual_seed(seed)
    w = len(tokens)
    e = w * num_local
    xs, idx, probs = [], [], []
    for m in tokens:
        xs.append(torch.randn((m, hidden), generator=g).to(x_dtype))
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]) if m else torch.zeros((0, topk))
        ids = ids.long()
        if holes:
            ids[torch.rand(ids.shape, generator=g) < holes] = -1
        idx.append(ids.to(torch.int32))
        probs.append(torch.softmax(torch.randn((m, topk), generator=g), dim=-1))
    if int8:
        w1 = torch.randint(-127, 128, (e, hidden, 2 * n), generator=g, dtype=torch.int8)
        w2 = torch.randint(-127, 128, (e, n, hidden), generator=g, dtype=torch.int8)
        s1 = (torch.rand((e, 2 * n), generator=g) + 0.5) / (127.0 * hidden**0.5)
        s2 = (torch.rand((e, hidden), generator=g) + 0.5) / (127.0 * n**0.5)
    else:
        w1 = (torch.randn((e, hidden, 2 * n), generator=g) / hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn((e, n, hidden), generator=g) / n**0.5).to(torch.bfloat16)
        s1 = s2 = None
    active = None
    if inactive is not None:
        active = [m - i for m, i in zip(tokens, inactive, strict=True)]
        for r, a in enumerate(active):
            garbage = torch.tensor([1 << 30, -5, 7, 7, -1, e][:topk] + [e + 3] * max(topk - 6, 0), dtype=torch.int32)
            idx[r][a:] = garbage
            probs[r][a:] = float("nan")
            xs[r][a:] = float("nan")
            xs[r][a + 1 :] = float("inf")
    return Case(xs, idx, probs, w1, w2, s1, s2, num_local, max(max(tokens), 1), active, swiglu_limit)


def oracle_quant(row: torch.Tensor) -> tuple[np.ndarray, float]:
    """Per-token int8 (the aclnn V2 docs): s = 127 / amax, q = rint(x * s), scale = amax / 127; numpy fp32."""
    v = row.float().numpy()
    amax = np.float32(np.abs(v).max()) if v.size else np.float32(0)
    if amax == 0:
        return np.zeros(v.shape, dtype=np.int64), 0.0
    s = np.float32(127.0) / amax
    q = np.clip(np.rint(v * s), -127, 127).astype(np.int64)
    return q, float(np.float32(amax / np.float32(127.0)))


def oracle_swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up of a `[1, 2N]` fp32 row (gate: the first N columns), clamped as the fused op when limit > 0."""
    gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2 :]
    if limit > 0:
        gate, up = torch.minimum(gate, torch.tensor(limit)), torch.clamp(up, -limit, limit)
    return F.silu(gate) * up


def oracle_ffn(x_row: torch.Tensor, e: int, case: Case, out_dtype: torch.dtype) -> torch.Tensor:
    """FFN of global expert ``e`` on one token `[K]` -> `[K]` out_dtype."""
    if case.s1 is None:
        wd = case.w1.dtype
        h = (x_row.float().unsqueeze(0) @ case.w1[e].float()).to(wd).float()
        g = oracle_swiglu(h, case.swiglu_limit).to(wd).float()
        return (g @ case.w2[e].float()).squeeze(0).to(out_dtype)
    q1, a1 = oracle_quant(x_row)
    return oracle_ffn_quantized(torch.from_numpy(q1), a1, e, case, out_dtype)


def oracle_ffn_quantized(q1: torch.Tensor, a1: float, e: int, case: Case, out_dtype: torch.dtype) -> torch.Tensor:
    """The int8 FFN from an already-quantized token (`[K]` int values and its scale)."""
    acc1 = q1.long().unsqueeze(0) @ case.w1[e].long()  # exact int64
    c1 = (acc1.double() * case.s1[e].double()).float().half()  # GMM1's fp16 output (gmC)
    h = c1.float() * torch.tensor(a1, dtype=torch.float32)
    q2, a2 = oracle_quant(oracle_swiglu(h, case.swiglu_limit).squeeze(0))
    acc2 = torch.from_numpy(q2).unsqueeze(0) @ case.w2[e].long()
    c2 = (acc2.double() * case.s2[e].double()).float().half()  # GMM2's fp16 tile
    return (c2.float() * torch.tensor(a2, dtype=torch.float32)).squeeze(0).to(out_dtype)


def dense_reference(case: Case, out_dtype: torch.dtype) -> list[torch.Tensor]:
    outs = []
    for r, (x, ids, p) in enumerate(zip(case.xs, case.idx, case.probs, strict=True)):
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)
        for t in range(x.shape[0] if case.active is None else case.active[r]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e >= 0:
                    out[t] += p[t, k] * oracle_ffn(x[t], e, case, out_dtype).float()
        outs.append(out.to(out_dtype))
    return outs


def assert_matches(got: torch.Tensor, ref: torch.Tensor, int8: bool) -> None:
    """The documented tolerance (see tests/compat/test_mega_moe.py): int8 >= 99% within 1 ulp and max error <= 2% of
    max |ref|; float weights rtol 1.6e-2, atol 1% of max |ref|."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.numel() == 0:
        return
    g, r = got.float(), ref.float()
    ulp = torch.finfo(ref.dtype).eps * r.abs().clamp(min=torch.finfo(ref.dtype).tiny)
    if int8:
        close = ((g - r).abs() <= ulp).float().mean().item()
        assert close >= 0.99, f"only {close:.3%} of elements within 1 ulp"
        assert (g - r).abs().max().item() <= 0.02 * r.abs().max().item()
    else:
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2 * r.abs().max().item())
