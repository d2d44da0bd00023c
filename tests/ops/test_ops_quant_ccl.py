"""Quantization numerics bit-exact against an independent numpy formula, and the CCL buffer size formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deep_ep_npu import get_low_latency_ccl_buffer_size
from deep_ep_npu.ops import MoeDistributeError
from deep_ep_npu.quant import per_group_int8, per_token_int8
from tests.support.ops_oracle import quant_int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smooth", [False, True])
def test_per_token_int8_bit_exact(dtype, smooth):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4000, 64, generator=g) * torch.rand(4000, 1, generator=g) * 10).to(dtype)
    x[7] = 0  # amax = 0: q = 0, scale = 0
    x[8, :] = 1.5  # every element at amax: q = 127 exactly
    sm = torch.rand(4000, 64, generator=g) + 0.5 if smooth else None
    q, scale = per_token_int8(x, sm)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (4000,)
    want = [quant_int8(x[i], None if sm is None else sm[i]) for i in range(x.shape[0])]
    np.testing.assert_array_equal(q.numpy(), np.stack([w[0] for w in want]))
    np.testing.assert_array_equal(scale.numpy(), np.array([w[1] for w in want], dtype=np.float32))
    assert float(scale[7]) == 0.0 and (smooth or int(q[8].min()) == 127)


def test_per_token_int8_ties_round_half_to_even():
    # amax = 127 makes the multiplier exactly 1, so x itself must be rounded: .5 ties go to the even integer
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]])
    q, scale = per_token_int8(x)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3]] and float(scale[0]) == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_group_int8_formula(dtype):
    """Combine comm quant (§3.3): scale = to_dtype(amax_g / 127) per 8 elements, q = rint(x / scale)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(200, 32, generator=g) * 3).to(dtype)
    x[3, :8] = 0
    q, scale = per_group_int8(x)
    xf = x.float().numpy().reshape(200, 4, 8)
    amax = np.abs(xf).max(axis=-1).astype(np.float32)
    want_scale = torch.from_numpy((amax / np.float32(127)).astype(np.float32)).to(dtype)
    assert torch.equal(scale, want_scale)
    sf = want_scale.float().numpy()[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        want_q = np.where(sf > 0, np.rint(xf / np.where(sf > 0, sf, 1)), 0)
    np.testing.assert_array_equal(q.numpy(), np.clip(want_q, -127, 127).astype(np.int8).reshape(200, 32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_int8_quant_nonfinite_policy(bad):
    """A row (group) with NaN / Inf: data stays in [-127, 127] (0 there, never -128), the scale is non-finite, so it
    dequantizes to NaN; the other rows are exactly what clean input gives."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn((4, 16), generator=g)
    dirty = x.clone()
    dirty[2, 5] = bad
    q, scale = per_token_int8(dirty)
    q_clean, scale_clean = per_token_int8(x)
    assert int(q.min()) >= -127 and not q[2].any() and not bool(torch.isfinite(scale[2]))
    assert (q[2].float() * scale[2]).isnan().all()
    keep = [0, 1, 3]
    assert torch.equal(q[keep], q_clean[keep]) and torch.equal(scale[keep], scale_clean[keep])
    qg, sg = per_group_int8(dirty.to(torch.bfloat16))
    qg_clean, sg_clean = per_group_int8(x.to(torch.bfloat16))
    assert int(qg.min()) >= -127 and not qg[2, :8].any() and not bool(torch.isfinite(sg[2, 0]))
    assert torch.equal(qg[2, 8:], qg_clean[2, 8:]) and torch.equal(qg[keep], qg_clean[keep])
    assert torch.equal(sg[keep], sg_clean[keep])


def test_ccl_buffer_size_worked_examples():
    for w in (2, 8, 16, 32, 64, 128, 256):  # W cancels out (W * L = E)
        assert get_low_latency_ccl_buffer_size(w, 128, 7168, 256, 8) == 479
        assert get_low_latency_ccl_buffer_size(w, 512, 7168, 256, 8) == 1913


def test_ccl_buffer_size_independent_formula():
    def mb(w, bs, h, e, k, s=0, sr=0, alg=""):
        tok = -(-(h * 2) // 32) * 32 + 44
        disp = -(-tok // 480) * 512 if alg == "fullmesh_v2" else -(-tok // 512) * 512
        comb = -(-(h * 2) // 512) * 512
        n = 2 * (bs * disp * w * (e // (w - sr)) + bs * comb * (k + s)) + (1 << 20)
        m = -(-n // (1 << 20))
        return (m + m % 2) // 2

    for args in [(4, 64, 4096, 64, 6, 1, 1, ""), (8, 512, 8192, 256, 16, 0, 0, "fullmesh_v2"), (3, 1, 1024, 3, 1)]:
        assert get_low_latency_ccl_buffer_size(*args) == mb(*args), args


@pytest.mark.parametrize(
    "args, param",
    [
        ((1, 128, 7168, 256, 8), "world_size"),
        ((2, 0, 7168, 256, 8), "num_max_dispatch_tokens_per_rank"),
        ((2, 128, 1000, 256, 8), "hidden"),
        ((2, 128, 7168, 2048, 8), "num_moe_expert"),
        ((2, 128, 7168, 256, 17), "topk"),
        ((2, 128, 7168, 256, 8, 5), "num_shared_expert"),
        ((4, 128, 7168, 256, 8, 1, 4), "num_shared_expert_ranks"),
        ((768, 128, 7168, 1024, 8, 0, 765), "num_moe_expert"),
    ],
)
def test_ccl_buffer_size_rejects(args, param):
    with pytest.raises(MoeDistributeError, match=param) as err:
        get_low_latency_ccl_buffer_size(*args)
    assert err.value.code == 561002 and err.value.param == param


def test_ccl_buffer_size_bad_comm_alg():
    with pytest.raises(MoeDistributeError) as err:
        get_low_latency_ccl_buffer_size(2, 128, 7168, 256, 8, comm_alg="hierarchy")
    assert err.value.code == 161002 and "hierarchy" in str(err.value)
