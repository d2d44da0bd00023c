"""The decode step's kernels against independent oracles: ``decode_attention`` (one call per layer: the step's keys /
values into the paged cache, then each sequence's attention) against a float64 loop over each sequence's keys;
``qk_norm_rope`` against the model's own per-head RMSNorm and rope ops (bf16: bit for bit); ``add_rms_norm`` against
torch's add then ``rms_norm``; and ``fuse_linears``' views."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deep_ep_npu import kernels
from deep_ep_npu.kernels.attention import decode_attention
from deep_ep_npu.kernels.rms_norm import add_rms_norm, rms_norm
from deep_ep_npu.kernels.rope import qk_norm_rope
from server.models.layers import DenseMLP
from server.models.linear import fuse_linears
from server.models.rope import RopeConfig, Rotary

H, KV, D, BLOCK = 8, 2, 32, 4


@pytest.fixture(autouse=True)
def _built(request: pytest.FixtureRequest) -> None:
    if kernels.library() is None and "fuse_linears" not in request.node.name:
        pytest.skip(kernels.unavailable())


def naive(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query `[H, D]` at ``pos`` over keys / values `[pos + 1, KV, D]`, in float64 -> `[H, D]`."""
    out = torch.empty(H, D, dtype=torch.float64)
    seen = [j for j in range(pos + 1) if window is None or j > pos - window]
    for h in range(H):
        g = h // (H // KV)
        logits = [float(q[h].double() @ keys[j, g].double()) * scale for j in seen]
        extra = [float(sinks[h])] if sinks is not None else []
        top = max(logits + extra)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights) + sum(math.exp(s - top) for s in extra)
        out[h] = sum(w / total * values[j, g].double() for w, j in zip(weights, seen, strict=True))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (5, False), (None, True), (3, True)])
def test_decode_attention_matches_float64(dtype: torch.dtype, window: int | None, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(0)
    positions = [9, 0, 3, 14, 4]  # one at position 0, one at a block's first slot, one mid-block
    num_blocks = 32
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered block tables
    tables = torch.tensor([order[4 * i : 4 * i + 4] for i in range(len(positions))])
    k_cache = torch.randn(num_blocks, BLOCK, KV, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV, D, generator=g).to(dtype)
    qkv = torch.randn(len(positions), (H + 2 * KV) * D, generator=g).to(dtype)
    pos = torch.tensor(positions)
    slots = tables[torch.arange(len(positions)), pos // BLOCK] * BLOCK + pos % BLOCK
    sinks = torch.randn(H, generator=g) if with_sinks else None
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = decode_attention(qkv, H, KV, D, k_cache, v_cache, slots, tables, pos, D**-0.5, window, sinks)
    assert out is not None and out.shape == (len(positions), H * D) and out.dtype == dtype
    flat_k, flat_v = k_cache.view(-1, KV, D), v_cache.view(-1, KV, D)
    assert torch.equal(flat_k[slots], qkv[:, H * D : (H + KV) * D].view(-1, KV, D))  # the step's keys / values
    assert torch.equal(flat_v[slots], qkv[:, (H + KV) * D :].view(-1, KV, D))
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots] = True
    assert torch.equal(flat_k[~written], before_k.view(-1, KV, D)[~written])  # nothing else
    assert torch.equal(flat_v[~written], before_v.view(-1, KV, D)[~written])
    for s, p in enumerate(positions):
        at = tables[s, torch.arange(p + 1) // BLOCK] * BLOCK + torch.arange(p + 1) % BLOCK
        ref = naive(qkv[s, : H * D].view(H, D), flat_k[at], flat_v[at], p, D**-0.5, window, sinks)
        if dtype == torch.float32:
            torch.testing.assert_close(out[s].view(H, D).double(), ref, atol=1e-5, rtol=1e-5)
        else:  # fp32 inside, one rounding to bf16 at the end: within one bf16 step of the exact value (seen: 0.63)
            exact = ref.to(dtype).abs()
            step = torch.nextafter(exact, torch.tensor(float("inf"), dtype=dtype)).double() - exact.double()
            assert bool(((out[s].view(H, D).double() - ref).abs() <= step).all()), s


def test_decode_attention_refuses_bad_arguments() -> None:
    k_cache = torch.zeros(4, BLOCK, KV, D)
    qkv, table = torch.zeros(2, (H + 2 * KV) * D), torch.zeros(2, 2, dtype=torch.int64)
    pos, slots = torch.tensor([1, 2]), torch.tensor([1, 16])  # slot 16 is past the cache's 16
    with pytest.raises(IndexError, match="outside the cache"):
        decode_attention(qkv, H, KV, D, k_cache, k_cache.clone(), slots, table, pos, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(torch.zeros(2, 10), H, KV, D, k_cache, k_cache.clone(), slots - 1, table, pos, 1.0)
    assert decode_attention(qkv.half(), H, KV, D, k_cache.half(), k_cache.half(), slots, table, pos, 1.0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("norm", "rotary_dim"), [(True, D), (False, D), (True, D // 2)])
def test_qk_norm_rope_is_the_model_ops(dtype: torch.dtype, norm: bool, rotary_dim: int) -> None:
    """bf16: equal to the model's ops (its RMSNorm kernel, then torch's rope) bit for bit; fp32: within rounding."""
    g = torch.Generator().manual_seed(rotary_dim)
    t = 5
    qkv = (torch.randn(t, (H + 2 * KV) * D, generator=g) * 3).to(dtype)
    rotary = Rotary(RopeConfig(theta=1e4, dim=rotary_dim))
    cos, sin = rotary.cos_sin(torch.tensor([0, 3, 17, 100, 4095]), dtype)
    q_w, k_w = (torch.randn(D, generator=g).to(dtype) for _ in range(2))
    q, k, v = qkv.clone().split([H * D, KV * D, KV * D], dim=-1)
    q, k = q.reshape(t, H, D), k.reshape(t, KV, D)
    if norm:
        if dtype == torch.bfloat16:
            q, k = rms_norm(q.contiguous(), q_w, 1e-6), rms_norm(k.contiguous(), k_w, 1e-6)
        else:
            q, k = (w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) for x, w in ((q, q_w), (k, k_w)))
    assert q is not None and k is not None
    q, k = rotary.apply(q, cos[:, None], sin[:, None]), rotary.apply(k, cos[:, None], sin[:, None])
    got = qkv.clone()
    assert qk_norm_rope(got, H, KV, D, cos, sin, q_w if norm else None, k_w if norm else None, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got[:, : H * D].view(t, H, D), q) and torch.equal(got[:, H * D : (H + KV) * D], k.flatten(1))
    else:
        torch.testing.assert_close(got[:, : H * D].view(t, H, D), q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:, H * D : (H + KV) * D], k.flatten(1), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, (H + KV) * D :], v)  # v untouched


def test_add_rms_norm_is_add_then_rms_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x, d = (torch.randn(7, 1000, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(1000, generator=g).bfloat16()
    expect_x = x + d
    expect_y = rms_norm(expect_x, w, 1e-6)
    got_x = x.clone()
    y = add_rms_norm(got_x, d, w, 1e-6)
    assert y is not None and torch.equal(got_x, expect_x) and torch.equal(y, expect_y)
    assert add_rms_norm(x.float(), d.float(), w.float(), 1e-6) is None  # not bf16: the torch code runs


def test_fuse_linears_keeps_names_and_shares_storage() -> None:
    layers = [nn.Linear(6, n, bias=True) for n in (4, 2, 2)]
    x = torch.randn(3, 6)
    expect = torch.cat([layer(x) for layer in layers], dim=-1)
    weight, bias = fuse_linears(*layers)
    assert bias is not None and weight.shape == (8, 6)
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, bias), expect)
    with torch.no_grad():
        layers[1].weight.copy_(torch.ones(2, 6))  # an in-place load reaches the fused weight
    assert torch.equal(weight[4:6], torch.ones(2, 6))
    assert [tuple(layer.state_dict()) for layer in layers] == [("weight", "bias")] * 3


def test_fuse_linears_follows_a_dtype_change() -> None:
    """``to()`` / ``float()`` after fusing: the fused weight takes the new dtype (it is not left behind as the old
    one) and the parameters are views of it again, so an in-place load still reaches it."""
    torch.manual_seed(0)
    mlp = DenseMLP(16, 8).bfloat16()
    mlp.fuse_weights()
    mlp.float()
    x = torch.randn(3, 16)
    w_gate, w_up, w_down = (p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    assert w_gate.dtype == torch.float32
    expect = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    torch.testing.assert_close(mlp(x), expect, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        mlp.up_proj.weight.copy_(torch.ones(8, 16))
    expect = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, torch.ones(8, 16)), w_down)
    torch.testing.assert_close(mlp(x), expect, rtol=1e-6, atol=1e-6)
    assert mlp._gate_up is not None and mlp.up_proj.weight.data_ptr() == mlp._gate_up[8:].data_ptr()
