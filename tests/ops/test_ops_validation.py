"""Bad input: every check raises MoeDistributeError with its aclnn code and a message naming the parameter and value.

Checks run before any communication, so a rank-local bad input makes every rank raise instead of hanging.
Table-driven cases run in one 1-rank (and one 2-rank) launch; hypothesis draws random bad inputs inside a rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.distributed import error_mismatches, op_error, parallel_launch

NULL, PARAM, SHAPE = 161001, 161002, 561002
H, E, K, BS = 16, 8, 2, 4


def _base() -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(BS)]).to(torch.int32)
    return dict(x=torch.randn(BS, H, generator=g), expert_ids=ids, moe_expert_num=E, kw={})


def _ids(rows):
    return torch.tensor(rows, dtype=torch.int32)


# name -> (mutation of the base dispatch call, code, parameter named in the error, text the message must contain)
DISPATCH_CASES = {
    "x_none": (lambda c: c.update(x=None), NULL, "x", "None"),
    "ids_none": (lambda c: c.update(expert_ids=None), NULL, "expert_ids", "None"),
    "group_none": (lambda c: c.update(group=None), NULL, "group_ep", "None"),
    "group_bad_name": (lambda c: c.update(group="no-such-group"), PARAM, "group_ep", "no-such-group"),
    "x_int_dtype": (lambda c: c.update(x=c["x"].to(torch.int32)), PARAM, "x", "torch.int32"),
    "ids_float": (lambda c: c.update(expert_ids=c["expert_ids"].float()), PARAM, "expert_ids", "torch.float32"),
    "x_3d": (lambda c: c.update(x=c["x"].unsqueeze(0)), SHAPE, "x", "(1, 4, 16)"),
    "ids_1d": (lambda c: c.update(expert_ids=c["expert_ids"][:, 0]), SHAPE, "expert_ids", "(4,)"),
    "ids_rows": (lambda c: c.update(expert_ids=c["expert_ids"][:3]), SHAPE, "expert_ids", "3 rows"),
    "k_zero": (lambda c: c.update(expert_ids=c["expert_ids"][:, :0]), SHAPE, "expert_ids", "(0, 16]"),
    "k_17": (
        lambda c: c.update(moe_expert_num=32, expert_ids=torch.arange(17, dtype=torch.int32).repeat(BS, 1)),
        SHAPE,
        "expert_ids",
        "17",
    ),
    "id_too_big": (lambda c: c.update(expert_ids=_ids([[0, 8]] * BS)), SHAPE, "expert_ids", "8"),
    "id_negative": (lambda c: c.update(expert_ids=_ids([[-3, 1]] * BS)), SHAPE, "expert_ids", "-3"),
    "id_repeated": (
        lambda c: c.update(expert_ids=_ids([[0, 1], [2, 2], [0, 1], [0, 1]])),
        SHAPE,
        "expert_ids",
        "row 1",
    ),
    "bs_513": (
        lambda c: c.update(x=torch.zeros(513, H), expert_ids=_ids([[0, 1]] * 513)),
        SHAPE,
        "x.shape[0] (Bs)",
        "513",
    ),
    "world_size_2": (lambda c: c.update(ep_world_size=2), SHAPE, "ep_world_size", "2"),
    "world_size_0": (lambda c: c.update(ep_world_size=0), SHAPE, "ep_world_size", "0"),
    "rank_1": (lambda c: c.update(ep_rank_id=1), SHAPE, "ep_rank_id", "1"),
    "rank_neg": (lambda c: c.update(ep_rank_id=-1), SHAPE, "ep_rank_id", "-1"),
    "experts_0": (lambda c: c.update(moe_expert_num=0), SHAPE, "moe_expert_num", "0"),
    "ccl_small": (
        lambda c: c.update(
            x=torch.zeros(128, 7168),
            expert_ids=torch.arange(8, dtype=torch.int32).repeat(128, 1),
            moe_expert_num=256,
            kw=dict(ccl_buffer_size=478),
        ),
        SHAPE,
        "ccl_buffer_size",
        "at least 479 MB",
    ),
    "quant_1": (lambda c: c["kw"].update(quant_mode=1), PARAM, "quant_mode", "1"),
    "ent_type_2": (lambda c: c["kw"].update(expert_token_nums_type=2), PARAM, "expert_token_nums_type", "2"),
    "scales_shape": (lambda c: c["kw"].update(scales=torch.ones(E, H + 1)), SHAPE, "scales", "(8, 17)"),
    "scales_dtype": (lambda c: c["kw"].update(scales=torch.ones(E, H, dtype=torch.bfloat16)), PARAM, "scales", "bf"),
    "mask_dtype": (lambda c: c["kw"].update(x_active_mask=torch.ones(BS)), PARAM, "x_active_mask", "float32"),
    "mask_not_prefix": (
        lambda c: c["kw"].update(x_active_mask=torch.tensor([True, False, True, False])),
        SHAPE,
        "x_active_mask",
        "prefix",
    ),
    "mask_2d_shape": (
        lambda c: c["kw"].update(x_active_mask=torch.ones(BS, K + 1, dtype=torch.bool)),
        SHAPE,
        "x_active_mask",
        "(4, 3)",
    ),
    "weights_shape": (lambda c: c["kw"].update(expert_scales=torch.ones(BS, K + 1)), SHAPE, "expert_scales", "(4, 3)"),
    "global_bs_small": (lambda c: c["kw"].update(global_bs=2), SHAPE, "global_bs", "2"),
    "global_bs_big": (lambda c: c["kw"].update(global_bs=513), SHAPE, "global_bs", "513"),
    "comm_alg": (lambda c: c["kw"].update(comm_alg="ring"), PARAM, "comm_alg", "ring"),
    "shard_type": (lambda c: c["kw"].update(expert_shard_type=1), PARAM, "expert_shard_type", "1"),
    "shared_num_5": (lambda c: c["kw"].update(shared_expert_num=5), PARAM, "shared_expert_num", "5"),
    "y_dtype": (lambda c: c["kw"].update(y_dtype=1), PARAM, "y_dtype", "1"),
    "strict_world": (
        lambda c: c.update(x=c["x"].bfloat16()) or c["kw"].update(strict=True),
        SHAPE,
        "ep_world_size",
        "[2, 768]",
    ),
}


def _call_dispatch(info, c):
    from deep_ep_npu.ops import moe_distribute_dispatch_v2

    return moe_distribute_dispatch_v2(
        c["x"],
        c["expert_ids"],
        c.get("group", info.group),
        c.get("ep_world_size", info.world_size),
        c.get("ep_rank_id", info.rank),
        c["moe_expert_num"],
        **c["kw"],
    )


def _run_dispatch_table(info):
    out = {}
    for name, (mutate, *_rest) in DISPATCH_CASES.items():
        c = _base()
        mutate(c)
        out[name] = op_error(lambda c=c: _call_dispatch(info, c))
    return out


def _run_combine_table(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    c = _base()
    w = torch.rand(BS, K)
    expand_x, _, assist, _, counts, _, _ = moe_distribute_dispatch_v2(c["x"], c["expert_ids"], info.group, 1, 0, E)
    base = dict(expand_x=expand_x, expert_ids=c["expert_ids"], assist=assist, counts=counts, weights=w, kw={})
    cases = {
        "expand_x_none": lambda b: b.update(expand_x=None),
        "weights_none": lambda b: b.update(weights=None),
        "assist_none": lambda b: b.update(assist=None),
        "counts_none": lambda b: b.update(counts=None),
        "expand_x_int8": lambda b: b.update(expand_x=b["expand_x"].to(torch.int8)),
        "weights_shape": lambda b: b.update(weights=torch.rand(BS, K + 1)),
        "shared_x_shape": lambda b: b["kw"].update(shared_expert_x=torch.zeros(BS, H + 1)),
        "shared_x_dtype": lambda b: b["kw"].update(shared_expert_x=torch.zeros(BS, H, dtype=torch.float16)),
        "counts_short": lambda b: b.update(counts=b["counts"][:2]),
        "counts_too_many": lambda b: b.update(counts=b["counts"] + 10_000),
        "comm_quant_1": lambda b: b["kw"].update(comm_quant_mode=1),
    }
    out = {}
    for name, mutate in cases.items():
        b = dict(base, kw={})
        mutate(b)
        out[name] = op_error(
            lambda b=b: moe_distribute_combine_v2(
                b["expand_x"], b["expert_ids"], b["assist"], b["counts"], b["weights"], info.group, 1, 0, E, **b["kw"]
            )
        )
    # unchanged inputs still work after all those rejections
    y = moe_distribute_combine_v2(expand_x, c["expert_ids"], assist, counts, w, info.group, 1, 0, E)
    want = torch.zeros_like(c["x"])
    for k in range(K):  # identity experts: sum_k w[t, k] * x[t], k ascending, fp32
        want += w[:, k : k + 1] * c["x"]
    out["ok"] = torch.equal(y, want)
    return out


COMBINE_EXPECT = {
    "expand_x_none": (NULL, "expand_x"),
    "weights_none": (NULL, "expert_scales"),
    "assist_none": (NULL, "assist_info_for_combine"),
    "counts_none": (NULL, "ep_send_counts"),
    "expand_x_int8": (PARAM, "expand_x"),
    "weights_shape": (SHAPE, "expert_scales"),
    "shared_x_shape": (SHAPE, "shared_expert_x"),
    "shared_x_dtype": (PARAM, "shared_expert_x"),
    "counts_short": (SHAPE, "ep_send_counts"),
    "counts_too_many": (SHAPE, "ep_send_counts"),
    "comm_quant_1": (PARAM, "comm_quant_mode"),
}


def test_dispatch_checks_one_rank():
    (got,) = parallel_launch(1, _run_dispatch_table, timeout=60)
    bad = []
    for name, (_, code, param, text) in DISPATCH_CASES.items():
        if got[name] is None:
            bad.append(f"{name}: no error raised")
            continue
        g_code, g_param, msg = got[name]
        if (g_code, g_param) != (code, param) or f"[aclnn {code}]" not in msg or text not in msg:
            bad.append(f"{name}: expected ({code}, {param}, ...{text}...), got {got[name]}")
    assert not bad, "\n".join(bad)


VALUE_CASES = ("id_too_big", "id_negative", "id_repeated", "mask_not_prefix")  # the checks that read values


def _run_dispatch_table_values_off(info):
    import os

    from deep_ep_npu import envs

    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = "0"
    envs.check_values.cache_clear()  # (read once per process)
    return _run_dispatch_table(info)


def test_dispatch_shape_checks_with_value_checks_off():
    """``DEEP_EP_NPU_CHECK_VALUES=0`` skips only the checks that read tensor values: every other case raises as
    before; the value cases are not reported (ids out of range are not sent, a repeated id is sent twice)."""
    (got,) = parallel_launch(1, _run_dispatch_table_values_off, timeout=60)
    for name, (_, code, param, _text) in DISPATCH_CASES.items():
        want = None if name in VALUE_CASES else (code, param)
        assert (got[name] and got[name][:2]) == want, (name, got[name])


def test_combine_checks_one_rank():
    (got,) = parallel_launch(1, _run_combine_table, timeout=60)
    assert got.pop("ok") is True
    for name, (code, param) in COMBINE_EXPECT.items():
        assert got[name] is not None, f"{name}: no error raised"
        assert got[name][:2] == (code, param), f"{name}: got {got[name]}"


def _two_rank_scenarios(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    r, g = info.rank, info.group
    c = _base()
    x, ids = c["x"], c["expert_ids"]
    out = {}

    def run(name, fn):
        out[name] = op_error(fn)

    bad_ids = ids.clone()
    if r == 1:
        bad_ids[0, 0] = 99
    run("rank_local_bad_id", lambda: moe_distribute_dispatch_v2(x, bad_ids, g, 2, r, E))
    run("moe_not_divisible", lambda: moe_distribute_dispatch_v2(x, ids % 3, g, 2, r, 3))
    run("strict_fp32", lambda: moe_distribute_dispatch_v2(x, ids, g, 2, r, E, strict=True))
    run("strict_hidden", lambda: moe_distribute_dispatch_v2(x.bfloat16(), ids, g, 2, r, E, strict=True))
    run("uneven_no_global_bs", lambda: moe_distribute_dispatch_v2(x[: BS - r], ids[: BS - r], g, 2, r, E))
    run("disagree_hidden", lambda: moe_distribute_dispatch_v2(x[:, : H - 8 * r], ids, g, 2, r, E))
    run("disagree_experts", lambda: moe_distribute_dispatch_v2(x, ids, g, 2, r, E + 2 * r))
    expand_x, _, assist, _, counts, _, _ = moe_distribute_dispatch_v2(x, ids, g, 2, r, E)
    w = torch.rand(BS, K)
    other_ids = (ids + 1) % E if r == 1 else ids
    run(
        "combine_mismatch",
        lambda: moe_distribute_combine_v2(expand_x, other_ids, assist, counts, w, g, 2, r, E),
    )
    run(
        "combine_rank_local_none",
        lambda: moe_distribute_combine_v2(expand_x, ids, assist, counts, None if r == 0 else w, g, 2, r, E),
    )
    y = moe_distribute_combine_v2(expand_x, ids, assist, counts, w, g, 2, r, E)  # the group still works
    want = torch.zeros_like(x)
    for k in range(K):
        want += w[:, k : k + 1] * x
    out["ok"] = torch.equal(y, want)
    return out


TWO_RANK_EXPECT = {  # name -> per rank (code, param, text)
    "rank_local_bad_id": [(SHAPE, "inputs", "rejected on rank 1"), (SHAPE, "expert_ids", "99")],
    "moe_not_divisible": [(SHAPE, "moe_expert_num", "not divisible")] * 2,
    "strict_fp32": [(PARAM, "x", "torch.float32")] * 2,
    "strict_hidden": [(SHAPE, "x.shape[1] (H)", "[1024, 8192]")] * 2,
    "uneven_no_global_bs": [(SHAPE, "global_bs", "[4, 3]")] * 2,
    "disagree_hidden": [(SHAPE, "hidden", "[16, 8]")] * 2,
    "disagree_experts": [(SHAPE, "moe_expert_num", "[8, 10]")] * 2,
    "combine_mismatch": [(SHAPE, "assist_info_for_combine", "dispatched")] * 2,
    "combine_rank_local_none": [(NULL, "expert_scales", "None"), (NULL, "inputs", "rejected on rank 0")],
}


@pytest.mark.parametrize("static", [False, True], ids=["checked", "static-round"])
def test_rank_local_errors_raise_on_every_rank(static: bool):
    """Each rank-local bad input raises on every rank. ``static``: value checks off, the torch code (the ops' static
    round, headers checked on the device): every case that is not a value check raises as with the checks on, on
    every rank, and the group still works after them; the bad id is not reported (not sent)."""
    results = parallel_launch(2, _two_rank_scenarios_static if static else _two_rank_scenarios, timeout=60)
    expect = {**TWO_RANK_EXPECT, "rank_local_bad_id": None} if static else TWO_RANK_EXPECT
    bad = []
    for r, got in enumerate(results):
        assert got.pop("ok") is True
        bad += error_mismatches(r, got, expect)
    assert not bad, "\n".join(bad)


@st.composite
def bad_dispatch(draw):
    """A valid 1-rank dispatch call with exactly one thing broken, plus the (code, param, text) it must raise."""
    bs, e = draw(st.integers(1, 6)), draw(st.sampled_from([4, 8, 16]))
    k = draw(st.integers(1, min(4, e)))
    x = torch.zeros(bs, H)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(bs)]).to(torch.int32)
    call = dict(x=x, expert_ids=ids, moe_expert_num=e, kw={})
    kind = draw(st.sampled_from(["topk", "id", "dup", "bs", "rank", "world", "dtype_x", "dtype_ids", "quant", "gbs"]))
    if kind == "topk":
        bad_k = draw(st.sampled_from([0, *range(17, 25)]))
        call.update(expert_ids=torch.arange(bad_k, dtype=torch.int32).repeat(bs, 1), moe_expert_num=32)
        return call, (SHAPE, "expert_ids", str(bad_k))
    if kind == "id":
        v = draw(st.integers(e, e + 100) | st.integers(-100, -1))
        ids[draw(st.integers(0, bs - 1)), draw(st.integers(0, k - 1))] = v
        return call, (SHAPE, "expert_ids", str(v))
    if kind == "dup" and k >= 2:
        t = draw(st.integers(0, bs - 1))
        ids[t, 1] = ids[t, 0]
        return call, (SHAPE, "expert_ids", f"row {t}")
    if kind == "bs":
        n = draw(st.integers(513, 600))
        call.update(x=torch.zeros(n, H), expert_ids=ids[:1].repeat(n, 1))
        return call, (SHAPE, "x.shape[0] (Bs)", str(n))
    if kind == "rank":
        v = draw(st.integers(-5, -1) | st.integers(1, 10))
        call["ep_rank_id"] = v
        return call, (SHAPE, "ep_rank_id", str(v))
    if kind == "world":
        v = draw(st.integers(-3, 0) | st.integers(2, 10))
        call["ep_world_size"] = v
        return call, (SHAPE, "ep_world_size", str(v))
    if kind == "dtype_x":
        dt = draw(st.sampled_from([torch.int8, torch.int32, torch.int64, torch.float64, torch.bool]))
        call["x"] = x.to(dt)
        return call, (PARAM, "x", str(dt))
    if kind == "dtype_ids":
        dt = draw(st.sampled_from([torch.float32, torch.int16, torch.uint8, torch.int8]))
        call["expert_ids"] = ids.to(dt)
        return call, (PARAM, "expert_ids", str(dt))
    if kind == "quant":
        v = draw(st.integers(-3, 10).filter(lambda q: q not in (0, 2, 3, 4, 5)))
        call["kw"]["quant_mode"] = v
        return call, (PARAM, "quant_mode", str(v))
    v = draw(st.integers(513, 2000) if bs == 1 else st.integers(1, bs - 1) | st.integers(513, 2000))
    call["kw"]["global_bs"] = v
    return call, (SHAPE, "global_bs", str(v))


def _check_drawn_errors(bad_inputs: st.SearchStrategy, max_examples: int, call) -> None:
    """For every ``(inp, (code, param, text))`` that ``bad_inputs`` draws, ``call(inp)`` raises MoeDistributeError
    with that code and param and ``text`` in its message."""

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bad_inputs)
    def check(case):
        inp, (code, param, text) = case
        got = op_error(lambda: call(inp))
        assert got is not None, f"no error for {case}"
        assert got[:2] == (code, param) and text in got[2], f"expected ({code}, {param}, {text}), got {got}"

    check()


def _hypothesis_in_rank(info):
    _check_drawn_errors(bad_dispatch(), 150, lambda call: _call_dispatch(info, call))
    return True


def test_random_bad_inputs_hypothesis():
    assert parallel_launch(1, _hypothesis_in_rank, timeout=120) == [True]


def _issue3_checks(info):
    """Issue 3's constraints, every rank passing the same bad input (W = 2)."""
    from deep_ep_npu.ops import get_low_latency_ccl_buffer_size, moe_distribute_combine_v2, moe_distribute_dispatch_v2

    g, r = info.group, info.rank
    x = torch.ones(BS, H)
    ids = _ids([[0, 1]] * BS)
    d = {}

    def disp(**kw):
        args = dict(x=x, ids=ids, e=E)
        args.update({k: kw.pop(k) for k in ("x", "ids", "e") if k in kw})
        return op_error(lambda: moe_distribute_dispatch_v2(args["x"], args["ids"], g, 2, r, args["e"], **kw))

    d["shared_num_no_ranks"] = disp(shared_expert_num=2)
    d["shared_ranks_no_num"] = disp(shared_expert_rank_num=1, shared_expert_num=0, e=4)
    d["shared_ranks_all"] = disp(shared_expert_rank_num=2)
    d["elastic_dtype"] = disp(elastic_info=torch.zeros(8, dtype=torch.int64))
    d["elastic_shape"] = disp(elastic_info=torch.zeros(7, dtype=torch.int32))
    d["elastic_table"] = disp(elastic_info=torch.tensor([1, 1, 0, 8, 0, 0, 0, 0], dtype=torch.int32))
    d["elastic_experts"] = disp(elastic_info=torch.tensor([1, 1, 0, 9, 0, -1, 0, -1], dtype=torch.int32))
    d["perf_shape"] = disp(performance_info=torch.zeros(3, dtype=torch.int64))
    d["perf_dtype"] = disp(performance_info=torch.zeros(2, dtype=torch.int32))
    d["special_id_range"] = disp(ids=_ids([[0, 9]] * BS), zero_expert_num=1)
    a3 = torch.ones(BS, 1024, dtype=torch.bfloat16)
    d["strict_a3_shape_ok"] = disp(
        x=a3, strict=True, ccl_buffer_size=get_low_latency_ccl_buffer_size(2, BS, 1024, E, K)
    )
    expand_x, _, assist, _, counts, _, _ = moe_distribute_dispatch_v2(x, ids, g, 2, r, E, copy_expert_num=1)
    w = torch.ones(BS, K)

    def comb(**kw):
        return op_error(
            lambda: moe_distribute_combine_v2(expand_x, ids, assist, counts, w, g, 2, r, E, copy_expert_num=1, **kw)
        )

    d["copy_no_ori_x"] = comb()
    d["ori_x_shape"] = comb(ori_x=torch.ones(BS, H + 1))
    d["ori_x_dtype"] = comb(ori_x=torch.ones(BS, H, dtype=torch.bfloat16))
    d["const_no_alpha"] = comb(ori_x=x, const_expert_num=1)
    d["const_v_shape"] = comb(
        ori_x=x,
        const_expert_num=1,
        const_expert_alpha_1=torch.ones(1, H),
        const_expert_alpha_2=torch.ones(1, H),
        const_expert_v=torch.ones(2, H),
    )
    d["comm_quant_hidden"] = op_error(
        lambda: moe_distribute_combine_v2(
            expand_x[:, :12].contiguous(),
            ids,
            assist,
            counts,
            w,
            g,
            2,
            r,
            E,
            ori_x=x[:, :12],
            comm_quant_mode=2,
            copy_expert_num=1,
        )
    )
    d["shared_x_with_shared_ranks"] = op_error(
        lambda: moe_distribute_combine_v2(
            expand_x, ids, assist, counts, w, g, 2, r, 4, shared_expert_rank_num=1, shared_expert_x=x
        )
    )
    return d


ISSUE3_EXPECT = {
    "shared_num_no_ranks": (PARAM, "shared_expert_num", "2"),
    "shared_ranks_no_num": (PARAM, "shared_expert_num", "[1, 4]"),
    "shared_ranks_all": (SHAPE, "shared_expert_rank_num", "[0, 1]"),
    "elastic_dtype": (PARAM, "elastic_info", "torch.int64"),
    "elastic_shape": (SHAPE, "elastic_info", "(7,)"),
    "elastic_table": (SHAPE, "elastic_info", "Table1"),
    "elastic_experts": (SHAPE, "elastic_info[3] (new_moe_expert_count)", "9"),
    "perf_shape": (SHAPE, "performance_info", "(3,)"),
    "perf_dtype": (PARAM, "performance_info", "torch.int32"),
    "special_id_range": (SHAPE, "expert_ids", "9"),
    "copy_no_ori_x": (NULL, "ori_x", "copy_expert_num"),
    "ori_x_shape": (SHAPE, "ori_x", "(4, 17)"),
    "ori_x_dtype": (PARAM, "ori_x", "bfloat16"),
    "const_no_alpha": (NULL, "const_expert_alpha_1", "const_expert_num"),
    "const_v_shape": (SHAPE, "const_expert_v", "(2, 16)"),
    "comm_quant_hidden": (SHAPE, "expand_x", "multiple of 8"),
    "shared_x_with_shared_ranks": (SHAPE, "shared_expert_x", "shared_expert_rank_num"),
}


def test_issue3_checks_two_ranks():
    bad = []
    for r, got in enumerate(parallel_launch(2, _issue3_checks, timeout=60)):
        ok = got.pop("strict_a3_shape_ok")
        assert ok is None, f"rank {r}: a valid A3 shape with the CCL size it needs was rejected: {ok}"
        bad += error_mismatches(r, got, ISSUE3_EXPECT)
    assert not bad, "\n".join(bad)


@st.composite
def bad_combine(draw):
    """A broken argument for a combine of ``_base()``'s 1-rank dispatch, plus the (code, param, text) it must raise."""
    kind = draw(st.sampled_from(["w_shape", "w_dtype", "x_dtype", "x_dims", "counts", "assist", "shared", "cq"]))
    if kind == "w_shape":
        rows, cols = draw(st.tuples(st.integers(1, 8), st.integers(1, 8)).filter(lambda s: s != (BS, K)))
        return dict(weights=torch.ones(rows, cols)), (SHAPE, "expert_scales", f"({rows}, {cols})")
    if kind == "w_dtype":
        dt = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int32]))
        return dict(weights=torch.ones(BS, K, dtype=dt)), (PARAM, "expert_scales", str(dt))
    if kind == "x_dtype":
        dt = draw(st.sampled_from([torch.int8, torch.int32, torch.float64, torch.uint8]))
        return dict(expand_x=lambda x: x.to(dt)), (PARAM, "expand_x", str(dt))
    if kind == "x_dims":
        n = draw(st.sampled_from([1, 3]))
        return dict(expand_x=lambda x: x.reshape(-1) if n == 1 else x.unsqueeze(0)), (SHAPE, "expand_x", "dims")
    if kind == "counts":
        extra = draw(st.integers(1, 10_000))
        return dict(counts=lambda c: c + extra), (SHAPE, "ep_send_counts", "rows")
    if kind == "assist":
        src = draw(st.integers(1, 50) | st.integers(-50, -1))
        return dict(assist=lambda a: torch.cat([a[:1] * 0 + src, a[1:]])), (SHAPE, "assist_info_for_combine", "source")
    if kind == "shared":
        h = draw(st.integers(1, 40).filter(lambda v: v != H))
        return dict(kw=dict(shared_expert_x=torch.zeros(BS, h))), (SHAPE, "shared_expert_x", f"({BS}, {h})")
    v = draw(st.integers(-5, 9).filter(lambda q: q not in (0, 2, 3, 4)))
    return dict(kw=dict(comm_quant_mode=v)), (PARAM, "comm_quant_mode", str(v))


def _hypothesis_combine_in_rank(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    c = _base()
    expand_x, _, assist, _, counts, _, _ = moe_distribute_dispatch_v2(c["x"], c["expert_ids"], info.group, 1, 0, E)
    base = dict(expand_x=expand_x, assist=assist, counts=counts, weights=torch.rand(BS, K), kw={})

    def combine(change):
        a = dict(base)
        for key, value in change.items():
            a[key] = value(base[key]) if callable(value) else value
        return moe_distribute_combine_v2(
            a["expand_x"], c["expert_ids"], a["assist"], a["counts"], a["weights"], info.group, 1, 0, E, **a["kw"]
        )

    _check_drawn_errors(bad_combine(), 100, combine)
    return True


def test_random_bad_combine_inputs_hypothesis():
    assert parallel_launch(1, _hypothesis_combine_in_rank, timeout=120) == [True]


def _two_rank_scenarios_static(info):
    import os

    from deep_ep_npu import envs, kernels

    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = "0"
    envs.check_values.cache_clear()  # (read once per process)
    with kernels.disabled():  # the torch code: the static round (deep_ep_npu.engine.static_flat)
        return _two_rank_scenarios(info)
