"""Fused MegaMoE (issue 8) against an independent single-process dense oracle and against the unfused path.

The oracle (``tests/support/mega_moe_oracle.py``) recomputes ``out[t] = sum_k p[t,k] * FFN_e(x[t])`` token by token from
the documented formula, with its own quantization (numpy, round half to even), int64 integer matmuls and per-token
loops; it imports nothing from ``deep_ep_npu``.

Tolerance (documented in docs/mega-moe.md): the int8 path equals the oracle except where a last-ulp fp32
difference (SiLU's vectorized vs scalar kernel, summation order) flips one int8 rounding of the SwiGLU output; such
a flip moves the output by about one quantization step, so we require >= 99% of elements within one unit in the
last place of ``out_dtype`` and every element within 2% of max |out| (measured: > 99.9% bit-equal). The
float-weight path differs only by BLAS summation order: rtol 1.6e-2 (bf16) and atol 1% of max |out|.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deep_ep_npu.ops import MoeDistributeError
from tests.support.distributed import parallel_launch
from tests.support.mega_moe_oracle import (
    Case,
    assert_matches,
    dense_reference,
    make_case,
    oracle_ffn,
    oracle_ffn_quantized,
)
from tests.support.mega_moe_run import run_fused

# ---------------------------------------------------------------- workers


def _run_unfused(info, case: Case, out_dtype: torch.dtype):
    """Buffer-free unfused path: one dispatch_v2 -> the oracle's per-expert FFN -> one combine_v2."""
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    x, idx, p, *_ = case.rank_args(info.rank)
    w, e = info.world_size, case.num_local * info.world_size
    ids = torch.where(idx >= 0, idx.long(), e + torch.arange(idx.shape[1]))  # -1 -> a zero expert per slot
    kw = dict(global_bs=case.num_max * w, zero_expert_num=idx.shape[1])
    expand_x, _, assist, counts, ep_recv_counts, _, _ = moe_distribute_dispatch_v2(
        x, ids, info.group, w, info.rank, e, **kw
    )
    rows, start = [], 0
    for j, c in enumerate(counts.tolist()):
        rows += [
            oracle_ffn(expand_x[start + i].to(x.dtype), info.rank * case.num_local + j, case, out_dtype)
            for i in range(c)
        ]
        start += c
    y = torch.stack(rows).float() if rows else torch.zeros((0, x.shape[1]))
    return moe_distribute_combine_v2(y, ids, assist, ep_recv_counts, p, info.group, w, info.rank, e, **kw).to(out_dtype)


def _run_buffer_unfused(info, case: Case, out_dtype: torch.dtype):
    """Buffer.low_latency_dispatch (int8 per-token or plain) -> the oracle's per-expert FFN -> low_latency_combine."""
    from deep_ep_npu import Buffer

    x, idx, p, *_ = case.rank_args(info.rank)
    e, n = case.num_local * info.world_size, case.num_max
    buf = Buffer(info.group, backend="reference", explicitly_destroy=True)
    int8 = case.s1 is not None
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
        x, idx, n, e, use_fp8=int8, quant_format="int8_per_token" if int8 else None
    )
    data = recv_x[0] if int8 else recv_x
    y = torch.zeros(data.shape, dtype=out_dtype)
    for j, c in enumerate(recv_count.tolist()):
        for i in range(c):
            g = info.rank * case.num_local + j
            if int8:
                y[j, i] = oracle_ffn_quantized(data[j, i], float(recv_x[1][j, i, 0]), g, case, out_dtype)
            else:
                y[j, i] = oracle_ffn(data[j, i], g, case, out_dtype)
    out, _, _ = buf.low_latency_combine(y, idx, p, handle)
    buf.destroy()
    return out


def _expect_errors(info, case: Case, bad_cases: list):
    """For each bad case, rank 1 alone gets the bad argument(s); every rank must raise (no hang). Runs them in turn
    on one group, which also shows that the group stays usable after a rejected call."""
    from deep_ep_npu.mega_moe import mega_moe

    results = []
    for bad in bad_cases:
        x, idx, p, w1, w2, *_ = case.rank_args(info.rank)
        kw = case.keywords(info.rank, info.world_size)
        args = dict(x=x, topk_idx=idx, topk_weights=p, w1=w1, w2=w2)
        if info.rank == 1:
            for name, value in bad.items():
                (args if name in args else kw)[name] = value
        try:
            mega_moe(info.group, **args, **kw)
            results.append(None)
        except MoeDistributeError as err:
            results.append((err.param, str(err)))
    return results


# ---------------------------------------------------------------- tests


def test_seed_default_case_int8():
    """The seed's default case: worldSize=2, M=16, K=128, N=128, topK=2, 16 experts per rank, fp16 out."""
    case = make_case(1, [16, 16], 128, 128, 2, 16)
    outs = parallel_launch(2, run_fused, case, dict(out_dtype=torch.float16, max_output_size=32), timeout=60)
    for got, ref in zip(outs, dense_reference(case, torch.float16), strict=True):
        assert_matches(got, ref, int8=True)


def test_seed_four_rank_case_scaled_down():
    """The seed's 4-rank case (M=2048, K=7168, N=4096, topK=8, 16 experts/rank) scaled to M=24, K=256, N=128."""
    case = make_case(2, [24, 24, 24, 24], 256, 128, 8, 16)
    outs = parallel_launch(4, run_fused, case, dict(out_dtype=torch.float16), timeout=60)
    for got, ref in zip(outs, dense_reference(case, torch.float16), strict=True):
        assert_matches(got, ref, int8=True)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16-weights"])
def test_zero_tokens_uneven_batches_and_no_expert_slots(int8):
    """Rank 1 has no tokens, ranks differ in M, some slots are -1; fused (by expert, by token) == oracle == unfused."""
    case = make_case(3, [7, 0, 12], 128, 64, 3, 4, int8=int8, holes=0.2)
    ref = dense_reference(case, torch.bfloat16)
    fused = parallel_launch(3, run_fused, case, dict(out_dtype=torch.bfloat16), timeout=60)
    by_token = parallel_launch(3, run_fused, case, dict(out_dtype=torch.bfloat16, segment_by="token"), timeout=60)
    unfused = parallel_launch(3, _run_unfused, case, torch.bfloat16, timeout=60)
    for r in range(3):
        assert fused[r].shape == (case.xs[r].shape[0], 128)
        assert_matches(fused[r], ref[r], int8)
        assert_matches(unfused[r], ref[r], int8)
        assert_matches(fused[r], unfused[r], int8)
        assert_matches(by_token[r], ref[r], int8)
        torch.testing.assert_close(fused[r].float(), by_token[r].float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16-weights"])
def test_equals_buffer_dispatch_experts_combine(int8):
    """Buffer.mega_moe == Buffer.low_latency_dispatch -> experts -> Buffer.low_latency_combine (DeepEP layout)."""
    case = make_case(6, [9, 0, 13], 128, 64, 4, 4, int8=int8, holes=0.1)
    fused = parallel_launch(3, run_fused, case, dict(out_dtype=torch.float16, via_buffer=True), timeout=60)
    unfused = parallel_launch(3, _run_buffer_unfused, case, torch.float16, timeout=60)
    for got, want in zip(fused, unfused, strict=True):
        assert_matches(got, want, int8)


def _run_one_combine(info, case: Case, out_dtype: torch.dtype):
    """One dispatch_v2 -> the implementation's grouped FFN over all local experts -> one combine_v2 (no segments)."""
    from deep_ep_npu.engine.ffn import grouped_ffn
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    x, idx, p, w1, w2, s1, s2 = case.rank_args(info.rank)
    w, e = info.world_size, case.num_local * info.world_size
    ids = torch.where(idx >= 0, idx.long(), e + torch.arange(idx.shape[1]))
    kw = dict(global_bs=case.num_max * w, zero_expert_num=idx.shape[1])
    quant_mode = 2 if s1 is not None else 0
    d = moe_distribute_dispatch_v2(x, ids, info.group, w, info.rank, e, quant_mode=quant_mode, **kw)
    y = grouped_ffn(d[0], d[1], d[3], range(case.num_local), w1, w2, s1, s2, out_dtype)
    return moe_distribute_combine_v2(y, ids, d[2], d[4], p, info.group, w, info.rank, e, **kw)


@pytest.mark.parametrize(
    "segments",
    [dict(segment_by="token", num_segments=3), dict(num_segments=1)],
    ids=["token-segments", "one-expert-segment"],
)
def test_segments_bit_equal_to_one_combine(segments):
    """segment_by="token": every token's pairs live in one segment, so segmenting changes no bit of the result; one
    expert segment is one combine of ``out_dtype`` rows."""
    case = make_case(7, [11, 0, 6], 128, 64, 3, 4, holes=0.1)
    seg = parallel_launch(3, run_fused, case, dict(out_dtype=torch.float16, **segments))
    one = parallel_launch(3, _run_one_combine, case, torch.float16, timeout=60)
    for got, want in zip(seg, one, strict=True):
        assert got.dtype == want.dtype == torch.float16
        assert torch.equal(got, want)


def test_single_rank_and_every_rank_empty():
    """W = 1 (the seed's lower bound) against the oracle; and a step where no rank has a token."""
    case = make_case(9, [10], 128, 64, 2, 4)
    (out,) = parallel_launch(1, run_fused, case, dict(out_dtype=torch.float16), timeout=60)
    assert_matches(out, dense_reference(case, torch.float16)[0], int8=True)
    empty = make_case(9, [0, 0], 128, 64, 2, 4)
    outs = parallel_launch(2, run_fused, empty, dict(out_dtype=torch.bfloat16), timeout=60)
    assert all(o.shape == (0, 128) and o.dtype == torch.bfloat16 for o in outs)


def test_fp32_reference_path_equals_unfused_exactly():
    """fp32 activations and weights: every expert output is exact fp32, so fused and unfused agree to fp32 rounding."""
    case = make_case(4, [5, 9], 64, 32, 2, 6, int8=False, x_dtype=torch.float32)
    case.w1, case.w2 = case.w1.float(), case.w2.float()
    fused = parallel_launch(2, run_fused, case, dict(num_segments=3), timeout=60)
    unfused = parallel_launch(2, _run_unfused, case, torch.float32, timeout=60)
    for got, want in zip(fused, unfused, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16-weights"])
def test_active_mask_with_garbage_rows_and_swiglu_limit(int8):
    """x_active_mask: rows after each rank's prefix hold out-of-range / negative / repeated ids, NaN weights and
    NaN / inf activations, yet are not checked, not dispatched and come back as exact zeros (rank 2: none active);
    swiglu_limit clamps (it changes the result) and matches the oracle; Buffer.mega_moe forwards both."""
    limit = 0.5 if int8 else 0.75
    case = make_case(11, [7, 6, 5], 128, 64, 3, 4, int8=int8, holes=0.1, inactive=[2, 0, 5], swiglu_limit=limit)
    ref = dense_reference(case, torch.bfloat16)
    unclamped = dense_reference(dataclasses.replace(case, swiglu_limit=0.0), torch.bfloat16)
    assert any(not torch.equal(a, b) for a, b in zip(ref, unclamped, strict=True))  # the limit is active
    outs = parallel_launch(3, run_fused, case, dict(out_dtype=torch.bfloat16), timeout=60)
    via_buffer = parallel_launch(3, run_fused, case, dict(out_dtype=torch.bfloat16, via_buffer=True), timeout=60)
    for r in range(3):
        assert_matches(outs[r], ref[r], int8)
        assert torch.equal(outs[r], via_buffer[r])
        assert bool((outs[r][case.active[r] :] == 0).all())


def _limit_off_variants(info, case: Case):
    """The same call with swiglu_limit omitted, None and 0.0."""
    from deep_ep_npu.mega_moe import mega_moe

    x, idx, p, w1, w2, *_ = case.rank_args(info.rank)
    kw = case.keywords(info.rank, info.world_size)
    return [
        mega_moe(info.group, x, idx, p, w1, w2, **kw, **extra)
        for extra in ({}, {"swiglu_limit": None}, {"swiglu_limit": 0.0})
    ]


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16-weights"])
def test_swiglu_limit_off_is_bit_identical(int8):
    case = make_case(12, [6, 9], 128, 64, 2, 4, int8=int8)
    for got in parallel_launch(2, _limit_off_variants, case, timeout=60):
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


BAD_INPUTS = [
    ({"max_output_size": 31}, "max_output_size"),
    ({"w1": torch.zeros((16, 128, 255), dtype=torch.int8)}, "w1"),
    ({"w2_scale": None}, "w2_scale"),
    ({"topk_idx": torch.full((16, 2), 32, dtype=torch.int32)}, "topk_idx"),
    ({"num_max_dispatch_tokens_per_rank": 20}, "num_max_dispatch_tokens_per_rank"),
    ({"out_dtype": torch.int8}, "out_dtype"),
    ({"x_active_mask": torch.tensor([False, True] * 8)}, "x_active_mask"),  # not a prefix
    ({"x_active_mask": torch.ones((15,), dtype=torch.bool)}, "x_active_mask"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"swiglu_limit": 7.0}, "swiglu_limit"),  # valid alone, but the other ranks pass none: they disagree
]


def test_invalid_input_raises_on_every_rank():
    """max_output_size < M * topK, bad w1 shape, one scale only, expert id out of range, ranks disagreeing on
    num_max_dispatch_tokens_per_rank, bad out_dtype, a non-prefix or mis-sized mask, a negative swiglu_limit, ranks
    disagreeing on swiglu_limit: rank 1 names the parameter, rank 0 raises too."""
    case = make_case(5, [16, 16], 128, 128, 2, 16)
    per_rank = parallel_launch(2, _expect_errors, case, [bad for bad, _ in BAD_INPUTS], timeout=60)
    for i, (_, param) in enumerate(BAD_INPUTS):
        on0, on1 = per_rank[0][i], per_rank[1][i]
        assert on0 is not None and on1 is not None, (param, on0, on1)
        assert on1[0] == param, (param, on1)
        assert "rank 1" in on0[1] or on0[0] == param, (param, on0)
        assert "allowed" in on1[1] or "must" in on1[1] or "<" in on1[1], on1
