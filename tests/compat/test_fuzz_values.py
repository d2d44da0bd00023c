"""Non-finite and huge values at every public entry point, on 2 ranks (docs/ops.md's "Non-finite input" policy).

Hypothesis draws special values (NaN, +-Inf, +-3.3e38, the largest bf16 magnitudes) and where they go: some tokens'
``x`` entries and top-k weights, on either rank. Each example runs every entry point twice on the same routing:
once with the clean inputs, once with the specials. The oracle is the clean run and the documented policy:

- dispatch: every received row of a token without specials is bit-identical to the clean run; the rows that
  differ are exactly the (special token, local expert) pairs routed to this rank (counted from every rank's inputs);
  such a row is, unquantized, the input row bit for bit; int8 (per token): data in [-127, 127] and, where the token
  holds NaN / Inf, all 0 with a non-finite scale; float8 (per group): a NaN / Inf group has a non-finite scale.
- combine (identity experts: the dispatched rows come back unchanged): a token without specials in ``x`` or its
  weights is bit-identical to the clean run; one with a NaN / Inf in either comes back with a non-finite entry.

Entry points: ``Buffer.low_latency_dispatch`` (bf16, fp8 e4m3, int8 per token) / ``low_latency_combine``,
``Buffer.low_latency_dispatch_flat`` / ``low_latency_combine_flat`` (quant_mode 0 / 2, comm_quant_mode 0 / 2), the
ops' ``moe_distribute_dispatch_v2`` (quant_mode 0, 2, 3 and 4) / ``moe_distribute_combine_v2`` and the two-stage
``moe_distribute_{dispatch,combine}_{setup,teardown}``. Both ranks draw the same examples (``derandomize``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from deep_ep_npu import Buffer
from deep_ep_npu import ops as ep_ops
from tests.support.distributed import lockstep, parallel_launch

N, H, E, K, W = 6, 256, 8, 3, 2
L = E // W
SPECIALS = [math.nan, math.inf, -math.inf, 3.3e38, -3.3e38]
FP8 = torch.float8_e4m3fn
EXAMPLES = 12


@st.composite
def examples(draw):
    """``(seed, x_specials, w_specials)``: lists of (rank, token, column or slot, value index)."""
    spot = st.tuples(st.integers(0, W - 1), st.integers(0, N - 1), st.integers(0, H - 1), st.integers(0, 4))
    slot = st.tuples(st.integers(0, W - 1), st.integers(0, N - 1), st.integers(0, K - 1), st.integers(0, 2))
    return draw(st.integers(0, 2**16)), draw(st.lists(spot, max_size=4)), draw(st.lists(slot, max_size=2))


def _inputs(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn((N, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return x, idx, torch.rand((N, K), generator=g) + 0.1


def _with_specials(x, w, rank: int, x_specials, w_specials):
    """Copies with the specials of this rank written in; the tokens holding NaN / Inf and those holding any."""
    x, w = x.clone(), w.clone()
    for r, t, c, v in x_specials:
        if r == rank:
            x[t, c] = SPECIALS[v]
    for r, t, k, v in w_specials:
        if r == rank:
            w[t, k] = SPECIALS[v]
    nonfinite = ~x.float().isfinite().all(1) | ~w.isfinite().all(1)
    touched = torch.zeros(N, dtype=torch.bool)
    touched[[t for r, t, _, _ in [*x_specials, *w_specials] if r == rank]] = True
    return x, w, nonfinite, touched


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes per row (`[rows, bytes]` uint8), so NaN compares equal to itself."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], math.prod(t.shape[1:]) * t.element_size())


# -- entry points: each returns (rows `[M, ...]`, scales `[M, ...]` or None, valid `[M]` bool) and a combine --------


def _masked(buf: Buffer, fmt: str | None):
    def dispatch(x, idx, w):
        use_fp8 = fmt is not None
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=use_fp8, quant_format=fmt)
        data, scales = recv if use_fp8 else (recv, None)
        valid = torch.arange(W * N).unsqueeze(0) < count.unsqueeze(1)  # rows are packed per local expert
        flat = data.reshape(L * W * N, H)
        combined = None
        if not use_fp8:
            combined = buf.low_latency_combine(recv, idx, w, handle)[0]
        return flat, None if scales is None else scales.reshape(L * W * N, -1), valid.reshape(-1), combined

    return dispatch


def _flat(buf: Buffer, quant_mode: int, comm_quant_mode: int):
    def dispatch(x, idx, w):
        out, _, _ = buf.low_latency_dispatch_flat(x, idx, N, E, quant_mode=quant_mode)
        valid = torch.arange(out.expand_x.shape[0]) < int(out.expert_token_nums.sum())
        scales = out.dynamic_scales.unsqueeze(1) if quant_mode else None
        combined = None
        if quant_mode == 0:
            combined = buf.low_latency_combine_flat(out.expand_x, idx, w, out.handle, comm_quant_mode=comm_quant_mode)[
                0
            ]
        return out.expand_x, scales, valid, combined

    return dispatch


def _ops_v2(group, rank: int, quant_mode: int, comm_quant_mode: int):
    y_dtype = {0: None, 2: torch.int8, 3: FP8, 4: FP8}[quant_mode]

    def dispatch(x, idx, w):
        ids = idx.to(torch.int32)
        expand_x, scales, assist, nums, recv_counts, _, _ = ep_ops.moe_distribute_dispatch_v2(
            x, ids, group, W, rank, E, quant_mode=quant_mode, y_dtype=y_dtype
        )
        valid = torch.arange(expand_x.shape[0]) < int(nums.sum())
        combined = None
        if quant_mode == 0:
            combined = ep_ops.moe_distribute_combine_v2(
                expand_x, ids, assist, recv_counts, w, group, W, rank, E, comm_quant_mode=comm_quant_mode
            )
        if scales is not None and scales.dim() == 1:
            scales = scales.unsqueeze(1)
        return expand_x, None if quant_mode == 0 else scales, valid, combined

    return dispatch


def _two_stage(group, rank: int, quant_mode: int):
    def dispatch(x, idx, w):
        ids = idx.to(torch.int32)
        y_dtype = torch.int8 if quant_mode else None
        y, expand_idx, cmd = ep_ops.moe_distribute_dispatch_setup(
            x, ids, group, W, rank, E, quant_mode=quant_mode, y_dtype=y_dtype
        )
        expand_x, scales, assist, nums = ep_ops.moe_distribute_dispatch_teardown(
            x, y, ids, cmd, group, W, rank, E, quant_mode=quant_mode
        )
        valid = torch.arange(expand_x.shape[0]) < int(nums.sum())
        combined = None
        if quant_mode == 0:
            qx, cmd2 = ep_ops.moe_distribute_combine_setup(expand_x, ids, assist, group, W, rank, E)
            combined = ep_ops.moe_distribute_combine_teardown(expand_x, qx, ids, expand_idx, w, cmd2, group, W, rank, E)
        return expand_x, scales.unsqueeze(1) if quant_mode else None, valid, combined

    return dispatch


def _entry_points(info, buf: Buffer) -> dict:
    g, me = info.group, info.rank
    return {
        "buffer_bf16": (_masked(buf, None), None),
        "buffer_fp8": (_masked(buf, "fp8_e4m3"), "group"),
        "buffer_int8": (_masked(buf, "int8_per_token"), "token"),
        "flat_q0_cq0": (_flat(buf, 0, 0), None),
        "flat_q0_cq2": (_flat(buf, 0, 2), None),
        "flat_q2": (_flat(buf, 2, 0), "token"),
        "v2_q0_cq0": (_ops_v2(g, me, 0, 0), None),
        "v2_q0_cq2": (_ops_v2(g, me, 0, 2), None),
        "v2_q2": (_ops_v2(g, me, 2, 0), "token"),
        "v2_q3": (_ops_v2(g, me, 3, 0), "group"),
        "v2_q4": (_ops_v2(g, me, 4, 0), "group"),
        "two_stage_q0": (_two_stage(g, me, 0), None),
        "two_stage_q2": (_two_stage(g, me, 2), "token"),
    }


def _special_rows(seed: int, me: int, x_specials) -> tuple[int, int, set[bytes]]:
    """From every rank's (seeded) inputs: the rows this rank receives from tokens whose ``x`` holds a special, those
    of them holding NaN / Inf, and the bytes of every rank's special token rows."""
    rows = nonfinite_rows = 0
    special: set[bytes] = set()
    for r in range(W):
        x, idx, w = _inputs(seed, r)
        x_bad, _, _, _ = _with_specials(x, w, r, x_specials, [])
        for t in sorted({t for rr, t, _, _ in x_specials if rr == r}):
            here = int((idx[t] // L == me).sum())
            rows += here
            nonfinite_rows += here * int(not bool(x_bad[t].float().isfinite().all()))
            special.add(bytes(_bits(x_bad[t : t + 1])[0]))
    return rows, nonfinite_rows, special


def _check_dispatch(name, kind, clean, bad, expected) -> None:
    rows, nonfinite_rows, special = expected
    rows0, scales0, valid, _ = clean
    rows1, scales1, valid1, _ = bad
    assert torch.equal(valid, valid1), name
    b0, b1 = _bits(rows0)[valid], _bits(rows1)[valid]
    if scales0 is not None:
        b0, b1 = torch.cat([b0, _bits(scales0)[valid]], 1), torch.cat([b1, _bits(scales1)[valid]], 1)
    differ = (b0 != b1).any(1)
    assert int(differ.sum()) == rows, (name, "rows that changed", int(differ.sum()), rows)
    data = rows1[valid][differ]
    if kind is None:  # unquantized: a special token's input row, bit for bit
        assert all(bytes(row) in special for row in _bits(data).unbind(0)), (name, "a row is not its input row")
        return
    scales = scales1[valid][differ].float()
    if data.dtype == torch.int8:
        assert int(rows1[valid].min()) >= -127, (name, "int8 data outside [-127, 127]")
    row_nonfinite = ~scales.isfinite().all(1)
    assert int(row_nonfinite.sum()) == nonfinite_rows, (name, "rows with a non-finite scale", nonfinite_rows)
    if kind == "token":  # per token: the whole row's data is 0, its (one) scale non-finite
        assert not data[row_nonfinite].any(), (name, "a non-finite row's int8 data must be 0")
    else:  # per group: a group whose data is NaN has a non-finite scale
        groups = data.float().reshape(data.shape[0], scales.shape[1], H // scales.shape[1])
        assert bool((~scales[groups.isnan().any(2)].isfinite()).all()), (name, "a NaN group with a finite scale")


def _check_combine(name, clean, bad, nonfinite, touched) -> None:
    out0, out1 = clean[3], bad[3]
    if out0 is None:
        return
    same = (_bits(out0) == _bits(out1)).all(1)
    assert bool(same[~touched].all()), (name, "a token without specials changed")
    assert bool((~out1[nonfinite].float().isfinite().all(1)).all()), (name, "a NaN / Inf token came back finite")


def _fuzz(info):
    buf = Buffer(info.group, timeout=20.0)
    entries = _entry_points(info, buf)
    ran = {name: 0 for name in entries} | {"with_nonfinite_x": 0, "with_special_weights": 0}

    @lockstep(EXAMPLES)
    @given(examples())
    def check(example):
        seed, x_specials, w_specials = example
        x, idx, w = _inputs(seed, info.rank)
        x_bad, w_bad, nonfinite, touched = _with_specials(x, w, info.rank, x_specials, w_specials)
        expected = _special_rows(seed, info.rank, x_specials)
        ran["with_nonfinite_x"] += any(not math.isfinite(SPECIALS[v]) for _, _, _, v in x_specials)
        ran["with_special_weights"] += bool(w_specials)
        for name, (dispatch, kind) in entries.items():
            clean, bad = dispatch(x, idx, w), dispatch(x_bad, idx, w_bad)
            _check_dispatch(name, kind, clean, bad, expected)
            _check_combine(name, clean, bad, nonfinite, touched)
            ran[name] += 1

    check()
    return ran


def test_specials_follow_the_policy_at_every_entry_point():
    ran = parallel_launch(W, _fuzz, timeout=240)
    assert ran[0] == ran[1], ran
    counts = ran[0].copy()
    assert counts.pop("with_nonfinite_x") >= 3 and counts.pop("with_special_weights") >= 3, ran
    assert set(counts.values()) == {EXAMPLES}, ran
