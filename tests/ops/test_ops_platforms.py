"""strict platforms ("a3" / "a5"), the Ascend 950 quant modes (quant_mode 2 fp8, 3, 4 with y_dtype; combine
comm_quant_mode 3 / 4), every comm_alg, and rows that x_active_mask excludes (garbage ids never validated).

The golden quantizers below are written from the reference formulas with numpy (an fp8 rounding of our own: nearest
value, ties to even, saturating), never by calling ``deep_ep_npu.quant``; routing comes from
``tests.support.ops_oracle``.
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch

from tests.support.distributed import error_mismatches, op_error, parallel_launch
from tests.support.ops_oracle import Layout, RankInput, from_bytes, routed_rows, to_bytes

NULL, PARAM, SHAPE = 161001, 161002, 561002
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {E4M3: (3, 7, 448.0, 8), E5M2: (2, 15, 57344.0, 15)}  # mantissa bits, bias, maxV, MX emax
MAXV = {torch.int8: 127.0, E4M3: 448.0, E5M2: 57344.0}


def fp8_round(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Nearest float8 value of float64 ``v`` (ties to even), saturated to +-maxV."""
    m, bias, vmax, _ = FP8[dtype]
    step = np.ldexp(1.0, np.maximum(np.frexp(v)[1] - 1, 1 - bias) - m)  # subnormals: the smallest normal's step
    return np.clip(np.rint(v / step) * step, -vmax, vmax)


def to_y(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return np.clip(np.rint(v), -127, 127) if dtype == torch.int8 else fp8_round(v.astype(np.float64), dtype)


def golden(x: torch.Tensor, mode: int, dtype: torch.dtype, smooth: torch.Tensor | None = None):
    """One row `[H]` quantized by the reference: (values as float64 `[H]`, scales as float32 / e8m0 codes)."""
    xf = x.float().numpy().astype(np.float32)
    if smooth is not None:
        xf = (xf * smooth.numpy().astype(np.float32)).astype(np.float32)
    vmax = np.float32(MAXV[dtype])
    if mode == 2:  # s = maxV / amax, q = rint(x * s), stored 1 / s = amax / maxV
        amax = np.float32(np.abs(xf).max())
        if amax == 0:
            return np.zeros(xf.shape), np.float32(0)
        return to_y((xf * (vmax / amax)).astype(np.float32), dtype), np.float32(amax / vmax)
    size = 128 if mode == 3 else 32
    blocks = [xf[i : i + size] for i in range(0, xf.size, size)]
    if mode == 3:  # per 128: scale = amax / maxV, q = cast(x / scale)
        scales = [np.float32(np.abs(b).max() / vmax) for b in blocks]
        q = [to_y((b / s).astype(np.float32), dtype) if s > 0 else 0 * b for b, s in zip(blocks, scales, strict=True)]
        return np.concatenate(q), np.array(scales, dtype=np.float32)
    emax, codes, q = FP8[dtype][3], [], []  # MX: code = max(floor(log2 amax) + 127 - emax, 0), q = x / 2^(code - 127)
    for b in blocks:
        amax = float(np.abs(b).max())
        code = 0 if amax == 0 else max(int(np.frexp(amax)[1]) - 1 + 127 - emax, 0)
        if mode == 5 and amax:  # MX_CLIP: code = ceil(log2(max(amax, 1e-4) * fp32(1 / maxV))) + 127
            y = float(np.float32(max(amax, 1e-4)) * np.float32(1 / vmax))
            code = int(np.ceil(np.log2(y))) + 127
        codes.append(code)
        q.append(fp8_round(np.ldexp(b.astype(np.float64), 127 - code), dtype))
    return np.concatenate(q), np.array(codes + [0] * (len(codes) % 2), dtype=np.uint8)


def test_golden_rounding_and_mx_bound():
    """Our fp8 rounding's ties and saturation; the MX error bound ``2^(floor(log2 amax) - 2)`` the docs state."""
    assert fp8_round(np.array([0.5 * 2**-9, 1.5 * 2**-9, 17.0, 19.0, 460.0, -1e9]), E4M3).tolist() == [
        0.0,
        2 * 2**-9,
        16.0,
        20.0,
        448.0,
        -448.0,
    ]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    for dtype in (E4M3, E5M2):
        for row in x:
            q, codes = golden(row, 4, dtype)
            deq = q * np.ldexp(1.0, np.repeat(codes[:3].astype(int), 32) - 127)
            amax = np.repeat(row.view(3, 32).abs().amax(1).numpy(), 32)
            assert (np.abs(deq - row.numpy()) <= np.ldexp(1.0, np.frexp(amax)[1] - 3)).all()


def _dispatch_cases(info, x, ids, smooth, cases):
    from deep_ep_npu.ops import moe_distribute_dispatch_v2

    out = []
    for mode, y_dtype, use_smooth in cases:
        kw = dict(quant_mode=mode, y_dtype=y_dtype, scales=smooth if use_smooth else None)
        res = moe_distribute_dispatch_v2(x[info.rank], ids[info.rank], info.group, 2, info.rank, 4, **kw)
        out.append([t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t for t in res[:2]])
        out[-1] += [res[0].dtype, res[1].dtype]
    return to_bytes(out)


QUANT_CASES = [  # (quant_mode, y_dtype as passed, smooth scales?), expected dtype
    ((2, None, True), torch.int8),
    ((2, E4M3, True), E4M3),
    ((2, 291, False), E5M2),
    ((3, 292, True), E4M3),
    ((3, E5M2, False), E5M2),
    ((4, 292, False), E4M3),
    ((4, E5M2, False), E5M2),
    ((4, 24, False), E4M3),
    ((5, E4M3, False), E4M3),
    ((5, 291, False), E5M2),
]


def test_950_quant_modes_two_ranks():
    """quant_mode 2 (int8 / e4m3 / e5m2), 3, 4 and 5 against the golden quantizers, row by row (H = 200: a partial
    128-group and a partial 32-block; torch dtypes and torch_npu codes alike)."""
    g = torch.Generator().manual_seed(7)
    bs, hidden, w, e, k = 5, 200, 2, 4, 2
    x = [(torch.randn(bs, hidden, generator=g) * torch.logspace(-2, 2, bs).unsqueeze(1)).bfloat16() for _ in range(w)]
    x[0][1] = 0  # amax = 0
    x[1][2, :64] *= 1000  # one loud group / block
    ids = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(bs)]).int() for _ in range(w)]
    smooth = torch.rand(e, hidden, generator=g) + 0.5
    results = parallel_launch(w, _dispatch_cases, x, ids, smooth, [c for c, _ in QUANT_CASES], timeout=60)
    per_dest = routed_rows([RankInput(x[r], ids[r]) for r in range(w)], Layout(w, e))
    for d, res in enumerate(map(from_bytes, results)):
        for ((mode, _, use_smooth), dtype), (data, scales, y_dt, s_dt) in zip(QUANT_CASES, res, strict=True):
            assert y_dt == dtype and s_dt == (torch.float8_e8m0fnu if mode >= 4 else torch.float32)
            width = {2: (), 3: (2,), 4: (8,), 5: (8,)}[mode]  # ceil(200 / 128) = 2; align2(ceil(200 / 32)) = 8
            assert tuple(scales.shape) == (bs * w * min(2, k), *width)
            got = data.view(dtype).float().numpy()
            got_scales = scales.numpy()
            rows = per_dest[d]
            for i, (r, t, _, ex) in enumerate(rows):
                want_q, want_s = golden(x[r][t], mode, dtype, smooth[ex] if use_smooth else None)
                np.testing.assert_array_equal(got[i], want_q, err_msg=f"dest {d} row {i} mode {mode} {dtype}")
                np.testing.assert_array_equal(got_scales[i], want_s, err_msg=f"dest {d} row {i} scales")
            assert not got[len(rows) :].any() and not got_scales[len(rows) :].any()


def _combine_mx(info, x, ids, weights):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    r, g = info.rank, info.group
    expand_x, _, assist, _, counts, _, _ = moe_distribute_dispatch_v2(x[r], ids[r], g, 2, r, 4)
    return [
        moe_distribute_combine_v2(expand_x, ids[r], assist, counts, weights[r], g, 2, r, 4, comm_quant_mode=m)
        for m in (3, 4)
    ]


def test_comm_quant_mx_two_ranks():
    """combine comm_quant_mode 3 (e5m2) / 4 (e4m3) with identity experts: every returned row is the golden MX round
    trip of x (rounded to bf16), summed in fp32 over k ascending; and within the documented bound of the plain sum."""
    g = torch.Generator().manual_seed(3)
    bs, hidden, w, k = 6, 96, 2, 2
    x = [(torch.randn(bs, hidden, generator=g) * 8).bfloat16() for _ in range(w)]
    ids = [torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(bs)]).int() for _ in range(w)]
    weights = [torch.rand(bs, k, generator=g) for _ in range(w)]
    for r, got in enumerate(parallel_launch(w, _combine_mx, x, ids, weights, timeout=60)):
        for dtype, y in zip((E5M2, E4M3), got, strict=True):
            for t in range(bs):
                q, codes = golden(x[r][t], 4, dtype)
                deq = (q * np.ldexp(1.0, np.repeat(codes.astype(int), 32)[:hidden] - 127)).astype(np.float32)
                deq = torch.from_numpy(deq).bfloat16().float()
                acc = torch.zeros(hidden)
                for j in range(k):
                    acc += weights[r][t, j] * deq
                assert torch.equal(y[t], acc.bfloat16()), (r, t, dtype)
                amax = x[r][t].float().view(-1, 32).abs().amax(1)  # |y' - y| <= 2^(floor(log2 amax_32) - 2) per row
                bound = weights[r][t].sum() * torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 3)
                plain = weights[r][t].sum() * x[r][t].float()  # + the bf16 rounding of the result
                err = (y[t].float() - plain).abs()
                assert (err <= bound.repeat_interleave(32) * (1 + 2**-8) + plain.abs() / 256).all(), (r, t, dtype)


ALGS = ("", "fullmesh", "fullmesh_v1", "fullmesh_v2", "hierarchy", "ccu")


def _comm_algs(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    r, g = info.rank, info.group
    gen = torch.Generator().manual_seed(5 + r)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(6)]).int()
    w = torch.rand(6, 3, generator=gen)
    out = {}
    for alg in ALGS:
        d = moe_distribute_dispatch_v2(x, ids, g, 2, r, 8, expert_scales=w, comm_alg=alg, quant_mode=2)
        expert_out = (d[0].float() * d[1].unsqueeze(1)).bfloat16()
        y = moe_distribute_combine_v2(expert_out, ids, d[2], d[4], w, g, 2, r, 8, expand_scales=d[6], comm_alg=alg)
        out[alg] = (*d, y)
    return {alg: all(torch.equal(a, b) for a, b in zip(out[""], res, strict=True)) for alg, res in out.items()}


def test_comm_algs_give_the_fullmesh_result():
    assert parallel_launch(2, _comm_algs, timeout=60) == [dict.fromkeys(ALGS, True)] * 2


def _masked(info):
    """Clean and garbage versions of the same call (1D and 2D masks): garbage ids (huge, negative, repeated, special)
    and NaN x / weights where the mask excludes them."""
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    r, g = info.rank, info.group
    gen = torch.Generator().manual_seed(11 + r)
    bs, k, e = 6, 3, 8
    x = torch.randn(bs, 32, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e + 2, generator=gen)[:k] for _ in range(bs)]).int()  # + zero + copy expert
    w = torch.rand(bs, k, generator=gen)
    mask1 = torch.arange(bs) < 4
    mask2 = torch.rand(bs, k, generator=gen) < 0.6
    mask2[0] = False  # a token with no active pair
    out = {}
    for name, mask in (("1d", mask1), ("2d", mask2)):
        pairs = mask.unsqueeze(1).expand(bs, k) if mask.dim() == 1 else mask
        junk = torch.tensor([2**31 - 1, -(2**31), -7, int(ids[1, 0]), e + 1], dtype=torch.int32)  # + a copy expert
        bad_ids = torch.where(pairs, ids, junk[torch.arange(bs * k).view(bs, k) % 5])
        bad_x = x.masked_fill(~pairs.any(1, keepdim=True), float("nan")) if mask.dim() == 1 else x
        bad_w = w.masked_fill(~pairs, float("nan"))
        res = []
        for ids_, x_, w_ in ((ids, x, w), (bad_ids, bad_x, bad_w)):
            kw = dict(x_active_mask=mask, zero_expert_num=1, copy_expert_num=1)
            d = moe_distribute_dispatch_v2(x_, ids_, g, 2, r, e, expert_scales=w_, quant_mode=2, **kw)
            expert_out = (d[0].float() * d[1].unsqueeze(1)).bfloat16()
            y = moe_distribute_combine_v2(expert_out, ids_, d[2], d[4], w_, g, 2, r, e, ori_x=x, **kw)
            res.append((*d, y))
        out[name] = [torch.equal(a, b) for a, b in zip(*res, strict=True)] + [bool(res[0][-1].abs().sum() > 0)]
    return out


def test_excluded_rows_are_neither_validated_nor_sent():
    for got in parallel_launch(2, _masked, timeout=60):
        assert got == {"1d": [True] * 9, "2d": [True] * 9}, got


def _errors(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    r, g = info.rank, info.group
    x = torch.ones(4, 1024, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    w = torch.ones(4, 2)

    def disp(x=x, **kw):
        return op_error(lambda: moe_distribute_dispatch_v2(x, ids, g, 2, r, 4, **kw))

    d = moe_distribute_dispatch_v2(x, ids, g, 2, r, 4)

    def comb(**kw):
        return op_error(lambda: moe_distribute_combine_v2(d[0], ids, d[2], d[4], kw.pop("w", w), g, 2, r, 4, **kw))

    a3, a5, h = dict(strict="a3"), dict(strict="a5"), dict(comm_alg="hierarchy", expert_scales=w)
    return {
        "a3_mode3": disp(quant_mode=3, y_dtype=E4M3, **a3),
        "a3_y_dtype": disp(quant_mode=2, y_dtype=E4M3, **a3),
        "a3_x_dtype": disp(x_dtype=torch.bfloat16, strict=True),
        "a3_comm_quant4": comb(comm_quant_mode=4, **a3),
        "a3_empty_w": comb(w=torch.empty(0), **a3),
        "a3_fullmesh": disp(comm_alg="fullmesh", **a3),
        "a3_ccu": disp(comm_alg="ccu", **a3),
        "a3_combine_v1": comb(comm_alg="fullmesh_v1", **a3),
        "a5_hierarchy": disp(**h, **a5),
        "a5_tp": disp(tp_world_size=2, **a5),
        "a5_elastic": comb(elastic_info=torch.zeros(8, dtype=torch.int32), **a5),
        "a5_combine_alg": comb(comm_alg="fullmesh_v2", **a5),
        "a5_mode4": disp(quant_mode=4, y_dtype=E5M2, **a5),
        "a5_ok": disp(quant_mode=4, y_dtype=292, **a5),
        "a5_empty_w_ok": comb(w=torch.empty(0), **a5),
        "bad_strict": disp(strict="a4"),
        "h_no_weights": disp(comm_alg="hierarchy"),
        "h_shared": disp(shared_expert_rank_num=1, **h),
        "h_zero": disp(zero_expert_num=1, **h),
        "h_mask2d": disp(x_active_mask=torch.ones(4, 2, dtype=torch.bool), **h),
        "h_perf": comb(performance_info=torch.zeros(2, dtype=torch.int64), comm_alg="hierarchy"),
        "h_tp": disp(tp_world_size=2, **h),
        "h_a3_world": disp(**h, **a3),
        "h_a3_bs": disp(x=torch.ones(257, 1024, dtype=torch.bfloat16), **h, **a3),
        "h_a3_hidden": disp(x=torch.ones(4, 7200, dtype=torch.bfloat16), **h, **a3),
        "fp4": disp(quant_mode=4, y_dtype=296),
        "hif8": disp(y_dtype=290),
        "mode3_no_y": disp(quant_mode=3),
        "mode4_scales": disp(quant_mode=4, y_dtype=E4M3, scales=torch.ones(4, 1024)),
        "mode1": disp(quant_mode=1),
        "mode5_scales": disp(quant_mode=5, y_dtype=E4M3, scales=torch.ones(4, 1024)),
        "mode5_int8": disp(quant_mode=5, y_dtype=torch.int8),
        "a3_mode5": disp(quant_mode=5, y_dtype=E4M3, **a3),
        "rank_local": disp(quant_mode=4, y_dtype=296 if r else E4M3),
    }


ERRORS = {  # name -> (code, param, text), on both ranks unless a pair is given
    "a3_mode3": (PARAM, "quant_mode", "Ascend 950 (A5) feature"),
    "a3_y_dtype": (PARAM, "y_dtype", "Ascend 950 (A5)"),
    "a3_x_dtype": (PARAM, "x_dtype", "Ascend 950 (A5)"),
    "a3_comm_quant4": (PARAM, "comm_quant_mode", "Ascend 950"),
    "a3_empty_w": None,
    "a3_fullmesh": (PARAM, "comm_alg", "Atlas A2"),
    "a3_ccu": (PARAM, "comm_alg", "no platform documents"),
    "a3_combine_v1": (PARAM, "comm_alg", "['', 'hierarchy']"),
    "a5_hierarchy": (PARAM, "comm_alg", "Atlas A3 feature"),
    "a5_tp": (PARAM, "tp_world_size", "Atlas A3"),
    "a5_elastic": (PARAM, "elastic_info", "Atlas A3"),
    "a5_combine_alg": (PARAM, "comm_alg", "allows ['']"),
    "a5_mode4": None,
    "a5_ok": None,
    "a5_empty_w_ok": None,
    "bad_strict": (PARAM, "strict", "'a4'"),
    "h_no_weights": (NULL, "expert_scales", "hierarchy"),
    "h_shared": (PARAM, "shared_expert_rank_num", "hierarchy"),
    "h_zero": (PARAM, "zero_expert_num", "hierarchy"),
    "h_mask2d": (PARAM, "x_active_mask", "hierarchy"),
    "h_perf": (PARAM, "performance_info", "hierarchy"),
    "h_tp": (PARAM, "tp_world_size", "hierarchy"),
    "h_a3_world": (SHAPE, "ep_world_size", "[16, 256]"),
    "h_a3_bs": (SHAPE, "x.shape[0] (Bs)", "[1, 256]"),
    "h_a3_hidden": (SHAPE, "x.shape[1] (H)", "[1024, 7168]"),
    "fp4": (PARAM, "y_dtype", "fp4"),
    "hif8": (PARAM, "y_dtype", "hifloat8"),
    "mode3_no_y": (PARAM, "y_dtype", "float8_e4m3fn"),
    "mode4_scales": (PARAM, "scales", "MX"),
    "mode1": (PARAM, "quant_mode", "static"),
    "mode5_scales": (PARAM, "scales", "quant_mode 5"),
    "mode5_int8": (PARAM, "y_dtype", "quant_mode 5 outputs"),
    "a3_mode5": (PARAM, "quant_mode", "Ascend 950 (A5) feature"),
    "rank_local": [(PARAM, "inputs", "rejected on rank 1"), (PARAM, "y_dtype", "fp4")],
}


def test_platform_and_feature_errors_on_every_rank():
    bad = []
    for r, got in enumerate(parallel_launch(2, _errors, timeout=60)):
        bad += error_mismatches(r, got, ERRORS)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "w, experts, hidden, text",
    [(16, 16 * 25, 1024, "L = 25"), (32, 32 * 17, 1024, "L * W = 544"), (16, 16, 1040, "multiple of 32")],
)
def test_hierarchy_a3_size_limits(w, experts, hidden, text):
    from deep_ep_npu.core.platforms import hierarchy_rules as _hierarchy
    from deep_ep_npu.ops import MoeDistributeError

    e = dict(
        shared_expert_rank_num=0,
        zero_expert_num=0,
        copy_expert_num=0,
        const_expert_num=0,
        world_size=w,
        num_local=experts // w,
    )
    a3 = types.SimpleNamespace(comm_alg="hierarchy", wait_stats=None, experts=types.SimpleNamespace(platform="a3", **e))
    with pytest.raises(MoeDistributeError, match=re.escape(text)):
        _hierarchy(a3, "x", hidden, None)
    experts = types.SimpleNamespace(platform=None, **e)
    plain = types.SimpleNamespace(comm_alg="hierarchy", wait_stats=None, experts=experts)
    _hierarchy(plain, "x", hidden, None)  # only "a3"


def test_mx_clip_edge_blocks():
    """quant_mode 5 (MX_CLIP) on edge blocks: all zero (code 0), below the 1e-4 floor, amax exactly maxV * 2^k (no
    rounding up), just above it (one step up: nothing saturates), Inf (code 0xFF, NaN elements)."""
    from deep_ep_npu.quant import mx_clip_fp8

    for dtype in (E4M3, E5M2):
        vmax = MAXV[dtype]
        x = torch.zeros(5, 32)
        x[1, 3], x[2, 0], x[3, 0], x[3, 1], x[4, 2] = 1e-7, vmax * 4, vmax * 4 * 1.01, 1.0, float("inf")
        q, codes = mx_clip_fp8(x.bfloat16(), dtype)
        codes = codes.view(torch.uint8)[:, 0].tolist()
        assert codes[0] == 0 and codes[2] == 129 and codes[3] == 130 and codes[4] == 255, codes
        for row in range(4):
            want_q, want_codes = golden(x[row].bfloat16(), 5, dtype)
            assert codes[row] == int(want_codes[0])
            np.testing.assert_array_equal(q[row].float().numpy(), want_q)
        assert (q[:4].float().abs() <= vmax).all() and q[4].float().isnan().all()
