"""CANN's ``mega_moe`` / ``get_symm_buffer_for_mega_moe`` (``deep_ep_npu.cann``; ``cann_ops_transformer.ops`` under the
sim): each activation (and A8W8-FP's MX path) against an fp32 FFN oracle written here (within bf16's rounding of h
and of the activation), shared experts, ``x_active_mask``, ``expert_token_nums``; vllm-ascend's A3 MegaMoE backend
replayed argument for argument (W8A8, BF16 and W4A8) and equal bit for bit to ``deep_ep_npu.mega_moe`` on the same
weights; bad input on every rank before any communication.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import assert_named, op_error, parallel_launch
from tests.support.ops_oracle import from_bytes, to_bytes

W, E, H, I, K, N = 2, 4, 64, 32, 2, 5  # noqa: E741
E4M3 = torch.float8_e4m3fn
ACTS = [
    ("swiglu", 0.8, None),
    ("swiglustep", 0.5, None),
    ("swigluoai", 1.5, {"alpha": 1.2, "beta": 0.5}),
    ("situglu", None, {"beta": 2.0, "linear_beta": 1.5}),
]


def _act(name: str, clamp, params, h: torch.Tensor) -> torch.Tensor:
    """The HC torchapi doc's activations, in fp32 (G: gate half, U: up half; clamp None = none)."""
    g, u = h[:, :I], h[:, I:]
    c, p = clamp or math.inf, params or {}
    gc, uc = torch.minimum(g, torch.tensor(c)), u.clamp(-c, c)
    if name == "swiglu":
        return F.silu(gc) * uc
    if name == "swiglustep":
        return torch.minimum(F.silu(g), torch.tensor(c)) * uc
    if name == "swigluoai":
        return gc * torch.sigmoid(p["alpha"] * gc) * (uc + p["beta"])
    lb = p.get("linear_beta")
    return p["beta"] * torch.tanh(g / p["beta"]) * torch.sigmoid(g) * (u if lb is None else lb * torch.tanh(u / lb))


def _data():
    g = torch.Generator().manual_seed(3)
    ranks = []
    for r in range(W):
        bs = N - r
        x = (torch.randn((bs, H), generator=g) / 2).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)]).int()
        ranks.append((x, ids, torch.rand((bs, K), generator=g)))
    w1 = (torch.randn((E, H, 2 * I), generator=g) / 8).bfloat16()
    w2 = (torch.randn((E, I, H), generator=g) / 6).bfloat16()
    shared = (
        (torch.randn((1, 2 * I, H), generator=g) / 8).bfloat16(),
        (torch.randn((1, H, I), generator=g) / 6).bfloat16(),
    )
    q1, q2 = (
        torch.randint(-127, 128, (E, H, 2 * I), generator=g).to(torch.int8),
        torch.randint(-127, 128, (E, I, H), generator=g).to(torch.int8),
    )
    s1, s2 = torch.rand((E, 2 * I), generator=g) / 2000 + 1e-4, torch.rand((E, H), generator=g) / 400 + 1e-4
    f1, f2 = (w1.transpose(1, 2).float() * 8).to(E4M3), (w2.transpose(1, 2).float() * 8).to(E4M3)
    c1 = torch.randint(122, 126, (E, 2 * I, -(-H // 64), 2), generator=g).to(torch.uint8)
    c2 = torch.randint(122, 126, (E, H, -(-I // 64), 2), generator=g).to(torch.uint8)
    return ranks, w1, w2, shared, (q1, q2, s1, s2), (f1, c1, f2, c2)


def _mx_e4m3(v: torch.Tensor) -> torch.Tensor:
    """MX e4m3 round trip per 32 along the last dim (the docs' rule: scale 2^(floor(log2 amax) - 8))."""
    blocks = v.reshape(*v.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 9), 1.0)
    return ((blocks / scale).clamp(-448, 448).to(E4M3).float() * scale).reshape(v.shape)


def _dequant(w: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """fp8 `[out, in]` times 2^(code - 127) per 32 inputs (codes `[out, ceil(in / 64), 2]`)."""
    scale = torch.ldexp(
        torch.ones_like(codes.reshape(w.shape[0], -1), dtype=torch.float32), codes.reshape(w.shape[0], -1).int() - 127
    )
    return w.float() * scale.repeat_interleave(32, -1)[:, : w.shape[1]]


def _uint64(scale: torch.Tensor) -> torch.Tensor:
    """The doc's encoding: fp32 bits as int32, widened to int64, viewed as uint64."""
    return scale.view(torch.int32).to(torch.int64).view(torch.uint64)


def _pack_int4(w: torch.Tensor) -> list[torch.Tensor]:
    """Per expert `[in, out]` int4 values -> `[in, out / 8]` int32, element j of a word in bits 4j..4j+3."""
    nib = (w.to(torch.int32) & 15).reshape(*w.shape[:-1], -1, 8)
    words = sum(nib[..., j].to(torch.int64) << (4 * j) for j in range(8))
    return list(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))


def _run(info, data: bytes):
    from deep_ep_npu import mega_moe as ours
    from deep_ep_npu import sim

    sim.install()
    from cann_ops_transformer.ops import get_symm_buffer_for_mega_moe, mega_moe

    r = info.rank
    ranks, w1, w2, (sh1, sh2), (q1, q2, s1, s2), fp8 = from_bytes(data)
    x, ids, weights = ranks[r]
    local = slice(r * E // W, (r + 1) * E // W)
    buf = get_symm_buffer_for_mega_moe(info.group, E, N, K, H, I)
    mask = torch.ones(x.shape[0], dtype=torch.int8)
    mask[-1] = 0
    out = {}
    for name, clamp, params in ACTS:
        out[name] = mega_moe(
            x,
            ids,
            weights,
            list(w1[local]),
            list(w2[local]),
            buf,
            activation=name,
            activation_clamp=clamp,
            activation_params=params,
            x_active_mask=mask,
            shared_l1_weights=sh1,
            shared_l2_weights=sh2,
        )
    # vllm-ascend's A3MegaMoEBackend (VA a3_mega_moe.py): W8A8 (2, 258, 258) then BF16 (0, None, None)
    sym = get_symm_buffer_for_mega_moe(
        info.group,
        E,
        max(1, N),
        K,
        hidden=H,
        intermediate_hidden=2 * I,
        max_recv_token_num=N * W * min(K, max(1, E // W)),
        dispatch_quant_mode=2,
        dispatch_quant_out_dtype=258,
    )
    replay = {}
    int4 = (q1[local] >> 4, q2[local] >> 4)  # values in [-8, 7]
    for quant, wtype, lim in ((2, 258, 0.7), (0, None, 0.0), (2, 285, 0.0)):
        sym.dispatch_quant_mode, sym.dispatch_quant_out_dtype = quant, (258 if quant else None)
        a, b = (q1[local], q2[local]) if quant else (w1[local], w2[local])
        a, b = int4 if wtype == 285 else (a, b)
        packed = [_pack_int4(a), _pack_int4(b)] if wtype == 285 else [list(a), list(b)]
        bias = dict(l1_bias=[torch.ones(2 * I)] * (E // W), l2_bias=[torch.ones(H)] * (E // W)) if wtype == 285 else {}
        sf = dict(l1_weights_sf=[_uint64(s) for s in s1[local]], l2_weights_sf=[_uint64(s) for s in s2[local]])
        got = mega_moe(
            x,
            ids.to(torch.int32),
            weights.to(torch.float32),
            *packed,
            sym,
            **(sf if quant else {}),
            **(bias or dict(l1_bias=None, l2_bias=None)),
            x_active_mask=mask.contiguous(),
            activation_clamp=lim if lim > 0 else None,
            weight1_type=wtype,
            weight2_type=wtype,
        )
        want = ours.mega_moe(
            info.group,
            x,
            ids,
            weights,
            a,
            b,
            w1_scale=s1[local] if quant else None,
            w2_scale=s2[local] if quant else None,
            num_max_dispatch_tokens_per_rank=N,
            num_experts=E,
            x_active_mask=mask.bool(),
            swiglu_limit=lim,
            num_segments=1,
        )
        replay[wtype] = torch.equal(got[0], want) and got[1].dtype == torch.int32
    # Ascend 950's A8W8-FP: fp8 [E/W, out, in] weights with e8m0 scales [E/W, out, ceil(in / 64), 2]
    f1, c1, f2, c2 = fp8
    mx = get_symm_buffer_for_mega_moe(info.group, E, N, K, H, I, dispatch_quant_mode=4, dispatch_quant_out_dtype=292)
    out["mxfp8"] = mega_moe(
        x,
        ids,
        weights,
        [f1[local]],
        list(f2[local]),
        mx,
        l1_weights_sf=[c1[local]],
        l2_weights_sf=list(c2[local]),
        x_active_mask=mask,
        activation_clamp=0.9,
    )
    lists = (list(w1[local]), list(w2[local]))
    errors = {
        "activation": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, activation="gelu")),
        "params": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, activation_params={"alpha": 1.0})),
        "int4": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, weight1_type=285)),
        "fp4": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, weight1_type=296)),
        "fp8": op_error(
            lambda: mega_moe(x, ids, weights, [w.to(torch.float8_e4m3fn) for w in lists[0]], lists[1], buf)
        ),
        "int8_mode0": op_error(lambda: mega_moe(x, ids, weights, list(q1[local]), list(q2[local]), buf)),
        "shared_bias": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, shared_l1_bias=[torch.zeros(2 * I)])),
        "ids": op_error(lambda: mega_moe(x, ids + E, weights, *lists, buf)),
        "num_experts": op_error(
            lambda: mega_moe(x, ids, weights, *lists, get_symm_buffer_for_mega_moe(info.group, 5, N, K, H, I))
        ),
        "one_rank": op_error(lambda: mega_moe(x, ids, weights, *lists, buf, activation="gelu" if r else "swiglu")),
    }
    return to_bytes((out, replay, errors))


def test_cann_mega_moe():
    data = _data()
    ranks, w1, w2, (sh1, sh2), _, (f1, c1, f2, c2) = data
    results = [from_bytes(b) for b in parallel_launch(W, _run, to_bytes(data), timeout=120)]
    all_ids = torch.cat([ids[: ids.shape[0] - 1] for _, ids, _ in ranks])  # the masked last row routes nowhere
    for r, (out, replay, errors) in enumerate(results):
        x, ids, weights = ranks[r]
        for name, clamp, params in ACTS:
            y, counts = out[name]
            want = torch.zeros((x.shape[0], H))
            for t in range(x.shape[0] - 1):
                xf = x[t : t + 1].float()
                for k in range(K):
                    e = int(ids[t, k])
                    want[t] += weights[t, k] * (_act(name, clamp, params, xf @ w1[e].float()) @ w2[e].float())[0]
                want[t] += (_act(name, clamp, params, xf @ sh1[0].float().T) @ sh2[0].float().T)[0]
            assert y.dtype == torch.bfloat16 and not y[-1].any(), name
            torch.testing.assert_close(y.float(), want, rtol=0.03, atol=0.03 * float(want.abs().max()), msg=name)
            assert counts.tolist() == torch.bincount(all_ids.long().flatten(), minlength=E)[r * 2 : r * 2 + 2].tolist()
        assert replay == {258: True, None: True, 285: True}, (r, replay)
        y, counts = out["mxfp8"]  # oracle: MX(x) @ W1 -> swiglu (clamp 0.9) -> MX -> @ W2, in fp32
        want = torch.zeros((x.shape[0], H))
        for t in range(x.shape[0] - 1):
            xq = _mx_e4m3(x[t : t + 1].float())
            for k in range(K):
                e = int(ids[t, k])
                h = _act("swiglu", 0.9, None, xq @ _dequant(f1[e], c1[e]).T)
                want[t] += weights[t, k] * (_mx_e4m3(h) @ _dequant(f2[e], c2[e]).T)[0]
        torch.testing.assert_close(y.float(), want.bfloat16().float(), rtol=0.02, atol=0.01 * float(want.abs().max()))
        expected = {
            "activation": "activation",
            "params": "activation_params",
            "int4": "l1_weights",
            "fp4": "weight1_type",
            "fp8": "l1_weights",
            "int8_mode0": "l1_weights",
            "shared_bias": "shared_l1_bias",
            "ids": "topk_idx",
            "num_experts": "sym_buffer.num_experts",
        }
        assert_named(errors, expected, r, "activation")  # rank 1's bad activation: rank 0 raises too


@pytest.mark.parametrize("name", [a[0] for a in ACTS])
def test_activation_matches_doc_formula(name):
    from deep_ep_npu.engine.ffn import Activation

    _, clamp, params = next(a for a in ACTS if a[0] == name)
    h = torch.randn(7, 2 * I, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(Activation(name, clamp or 0.0, **(params or {}))(h), _act(name, clamp, params, h))
