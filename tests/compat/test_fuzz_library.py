"""Property-based fuzz of the library's input validation on 2 ranks (issue 9, "Bad input", library half).

Hypothesis draws a corruption (bad dtype, shape, id, flag, parameter combination, or a parameter that differs
across ranks), which ranks get it and each rank's batch size, for ``Buffer.low_latency_dispatch`` /
``low_latency_combine`` and the ops' ``moe_distribute_dispatch_v2``. Every case must raise the documented
``MoeDistributeError`` (a ValueError) on every rank, naming the corrupted parameter on a rank that holds the bad
input (a clean peer may instead report that a peer rejected its input), nothing may hang (every collective is
bounded; the launch has a timeout), and after each case a valid dispatch -> combine must equal the oracle
``x * sum(topk_weights)`` (identity experts), so the group is still usable.

Both ranks run hypothesis with ``derandomize=True`` (same examples in the same order); each example's description
is checked to be identical on both ranks before it runs.
"""

from __future__ import annotations

import datetime
import types
import zlib

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from deep_ep_npu import Buffer, MoeDistributeError
from deep_ep_npu import ops as ep_ops
from tests.support.distributed import lockstep, parallel_launch

N, H, E, K, W = 8, 128, 8, 3, 2
EXAMPLES_PER_CASE = 6

# corruption -> (the call it targets, the parameter the error must name on a bad rank, may only one rank hold it)
CASES = {
    "x_dtype": ("dispatch", "x", False),
    "x_ndim": ("dispatch", "x", False),
    "too_many_tokens": ("dispatch", "topk_idx", False),
    "idx_dtype": ("dispatch", "topk_idx", False),
    "idx_rows": ("dispatch", "topk_idx", False),
    "idx_range": ("dispatch", "topk_idx", False),
    "idx_dup": ("dispatch", "topk_idx", False),
    "topk_too_wide": ("dispatch", "topk_idx", False),
    "n_invalid": ("dispatch", "num_max_dispatch_tokens_per_rank", False),
    "n_differs": ("dispatch", "num_max_dispatch_tokens_per_rank", True),
    "experts_indivisible": ("dispatch", "num_experts", False),
    "experts_differ": ("dispatch", "num_experts", True),
    "hidden_differs": ("dispatch", "hidden", True),
    "fp8_hidden": ("dispatch", "x", False),
    "recv_stats": ("dispatch", "cumulative_local_expert_recv_stats", False),
    "wait_stats": ("dispatch", "dispatch_wait_recv_cost_stats", False),
    "both_overlaps": ("dispatch", "async_finish", False),
    "ue8m0_alone": ("dispatch", "use_ue8m0", False),
    "flag_type": ("dispatch", "use_fp8", False),
    "quant_format": ("dispatch", "quant_format", False),
    "cx_shape": ("combine", "x", False),
    "cx_dtype": ("combine", "x", False),
    "weights_dtype": ("combine", "topk_weights", False),
    "weights_shape": ("combine", "topk_weights", False),
    "cidx_range": ("combine", "topk_idx", False),
    "handle_type": ("combine", "handle", False),
    "handle_layout": ("combine", "handle.layout_range", False),
    "out_shape": ("combine", "out", False),
    "other_topk": ("combine", "handle", True),
    "op_ids_range": ("op", "expert_ids", False),
    "op_rank_id": ("op", "ep_rank_id", False),
    "op_world_size": ("op", "ep_world_size", False),
    "op_quant_mode": ("op", "quant_mode", False),
    "op_x_dtype": ("op", "x", False),
    "op_expert_num": ("op", "moe_expert_num", False),
}
# fmt: off
# corruption -> (target, parameter the error must name on a bad rank, corrupt(v, args)) for the flat methods,
# combine_v2 and the two-stage ops (``_run_extra``)
EXTRA = {
    # Buffer.low_latency_dispatch_flat: errors name the method's parameters, not the op's
    "flat_quant_mode": ("flat", "quant_mode", lambda v, a: a.kw.update(quant_mode=[1, 3, 5, -1][v])),
    "flat_smooth": ("flat", "smooth_scales",
                    lambda v, a: a.kw.update(quant_mode=2, smooth_scales=torch.ones(E + 2 + v, H))),
    "flat_weights": ("flat", "topk_weights", lambda v, a: a.kw.update(topk_weights=[a.w.double(), a.w[:, :1]][v % 2])),
    "flat_mask": ("flat", "x_active_mask",
                  lambda v, a: a.kw.update(x_active_mask=torch.ones(a.x.shape[0] + 1 + v, dtype=torch.bool))),
    "flat_token_nums_type": ("flat", "expert_token_nums_type",
                             lambda v, a: a.kw.update(expert_token_nums_type=[2, -1, 3, 9][v])),
    "flat_zero_experts": ("flat", "zero_expert_num", lambda v, a: a.kw.update(zero_expert_num=-1 - v)),
    "flat_ids": ("flat", "topk_idx", lambda v, a: a.idx.__setitem__((0, 0), E + v)),
    # Buffer.low_latency_combine_flat, after a valid flat dispatch
    "fc_x_dtype": ("flat_combine", "x", lambda v, a: setattr(a, "rows", a.rows.to(torch.int32))),
    "fc_weights": ("flat_combine", "topk_weights", lambda v, a: setattr(a, "w", [a.w.double(), a.w.half()][v % 2])),
    "fc_comm_quant": ("flat_combine", "comm_quant_mode", lambda v, a: a.kw.update(comm_quant_mode=[1, 5, -1, 7][v])),
    "fc_shared_x": ("flat_combine", "shared_expert_x", lambda v, a: a.kw.update(shared_expert_x=a.x[:, :-1])),
    "fc_out": ("flat_combine", "out",
               lambda v, a: a.kw.update(out=torch.empty((a.x.shape[0] + 1, H), dtype=a.x.dtype))),
    "fc_handle": ("flat_combine", "handle", lambda v, a: setattr(a, "handle", [None, (1, 2), "h", 3][v])),
    # ops.moe_distribute_combine_v2, after a valid dispatch_v2
    "oc_x_dtype": ("op_combine", "expand_x", lambda v, a: setattr(a, "rows", a.rows.to(torch.int32))),
    "oc_ids": ("op_combine", "expert_ids", lambda v, a: a.ids.__setitem__((0, 0), E + v)),
    "oc_assist": ("op_combine", "assist_info_for_combine", lambda v, a: setattr(a, "assist", a.assist[: 3 + v])),
    "oc_counts": ("op_combine", "ep_send_counts", lambda v, a: setattr(a, "counts", a.counts[:1])),
    "oc_scales": ("op_combine", "expert_scales", lambda v, a: setattr(a, "w", [a.w.double(), a.w.half()][v % 2])),
    "oc_comm_quant": ("op_combine", "comm_quant_mode", lambda v, a: a.kw.update(comm_quant_mode=[1, 5, -1, 7][v])),
    # the two-stage ops: setups are validated on every rank (teardowns locally: LOCAL)
    "ts_comm_type": ("setup", "comm_type", lambda v, a: a.kw.update(comm_type=[3, -1, 4, 9][v])),
    "ts_shared_ranks": ("setup", "shared_expert_rank_num", lambda v, a: a.kw.update(shared_expert_rank_num=1)),
    "ts_mask_2d": ("setup", "x_active_mask",
                   lambda v, a: a.kw.update(x_active_mask=torch.ones(a.ids.shape, dtype=torch.bool))),
    "ts_y_dtype": ("setup", "y_dtype", lambda v, a: a.kw.update(quant_mode=2)),
    "ts_comm_alg": ("setup", "comm_alg", lambda v, a: a.kw.update(comm_alg=["fullmesh", "hierarchy", "x", "ccu"][v])),
    "ts_ids": ("setup", "expert_ids", lambda v, a: a.ids.__setitem__((0, 0), E + v)),
    "cs_comm_quant": ("combine_setup", "comm_quant_mode", lambda v, a: a.kw.update(comm_quant_mode=[2, 3, 4, 1][v])),
    "cs_x_dtype": ("combine_setup", "expand_x", lambda v, a: setattr(a, "rows", a.rows.to(torch.int32))),
    "cs_assist": ("combine_setup", "assist_info_for_combine", lambda v, a: setattr(a, "assist", a.assist[: 1 + v])),
}
# fmt: on
LOCAL = {"td_cmd": "comm_cmd_info", "ctd_cmd": "comm_cmd_info"}  # teardown errors: local, the call can be redone
CASES.update({name: (target, param, False) for name, (target, param, _) in EXTRA.items()})
CASES.update({name: ("teardown", param, False) for name, param in LOCAL.items()})


@st.composite
def cases(draw, name: str):
    bad = (draw(st.integers(0, W - 1)),) if CASES[name][2] else draw(st.sampled_from([(0,), (1,), (0, 1)]))
    num_tokens = tuple(draw(st.integers(1, N)) for _ in range(W))
    return name, bad, num_tokens, draw(st.integers(0, 3)), draw(st.integers(0, 2**16))


def _inputs(rank: int, num_tokens: int, seed: int, hidden: int = H, k: int = K):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = (torch.randn((num_tokens, hidden), generator=g) * 2).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(num_tokens)]).view(num_tokens, k)
    return x, idx, torch.rand((num_tokens, k), generator=g)


def _corrupt_dispatch(name: str, v: int, x, idx, kw: dict):
    """Return (x, idx, num_max, num_experts) with the corruption applied; may edit ``kw``."""
    num_max, num_experts = N, E
    if name == "x_dtype":
        x = x.to([torch.int32, torch.float64, torch.int8, torch.bool][v])
    elif name == "x_ndim":
        x = x.reshape(-1) if v % 2 else x.unsqueeze(0)
    elif name == "too_many_tokens":
        x, idx, _ = _inputs(0, N + 1 + v, v)
    elif name == "idx_dtype":
        idx = idx.to([torch.float32, torch.int16, torch.uint8, torch.float64][v])
    elif name == "idx_rows":
        idx = torch.cat([idx, idx[:1]])
    elif name == "idx_range":
        idx[0, 0] = [E, E + 5, -2, -100][v]
    elif name == "idx_dup" and K > 1:
        idx[0, 1] = idx[0, 0]
    elif name == "topk_too_wide":
        idx = torch.cat([idx, torch.full((idx.shape[0], 17 - K), -1, dtype=idx.dtype)], dim=1)
    elif name == "n_invalid":
        num_max = [0, -1, "8", 2.5][v]
    elif name == "n_differs":
        num_max = N + 8
    elif name == "experts_indivisible":
        num_experts = E + 1
    elif name == "experts_differ":
        num_experts = 2 * E
    elif name == "hidden_differs":
        x = torch.cat([x, x], dim=1)
    elif name == "fp8_hidden":
        x, kw["use_fp8"] = x[:, : H - 1 - 8 * v], True
    elif name == "recv_stats":
        kw["cumulative_local_expert_recv_stats"] = [torch.zeros(E // W + 1, dtype=torch.int32), torch.zeros(E // W)][
            v % 2
        ]
    elif name == "wait_stats":
        kw["dispatch_wait_recv_cost_stats"] = [torch.zeros(W + 1, dtype=torch.int64), torch.zeros(W)][v % 2]
    elif name == "both_overlaps":
        kw["async_finish"] = kw["return_recv_hook"] = True
    elif name == "ue8m0_alone":
        kw["use_fp8"], kw["use_ue8m0"] = True, True
    elif name == "flag_type":
        kw["use_fp8"] = ["yes", 1, None, 0.0][v]
    elif name == "quant_format":
        kw["use_fp8"], kw["quant_format"] = True, ["fp4", "", "int4", "FP8_E4M3"][v]
    return x, idx, num_max, num_experts


def _corrupt_combine(name: str, v: int, recv_x, idx, w, handle, kw: dict):
    if name == "cx_shape":
        recv_x = recv_x[:, :-1] if v % 2 else recv_x[..., :-1]
    elif name == "cx_dtype":
        recv_x = recv_x.to(torch.int32)
    elif name == "weights_dtype":
        w = w.to([torch.float64, torch.bfloat16, torch.int32, torch.float16][v])
    elif name == "weights_shape":
        w = w[:, :-1]
    elif name == "cidx_range":
        idx = idx.clone()
        idx[0, 0] = E + v
    elif name == "handle_type":
        handle = [None, "handle", (1, 2, 3), 42][v]
    elif name == "handle_layout":
        handle = (handle[0], handle[1][:, :-1], N, H, E)
    elif name == "out_shape":
        kw["out"] = torch.empty((idx.shape[0] + 1, H), dtype=recv_x.dtype)
    elif name == "other_topk":
        idx = idx.clone()
        idx[0] = -1  # routes fewer tokens than the dispatch did: the handle no longer matches
    return recv_x, idx, w, handle


def _scale(expert: torch.Tensor) -> torch.Tensor:
    """The test's experts: global expert e multiplies its rows by ``1 + e / 8`` (distinct per expert, so weights
    swapped between a token's slots change the result)."""
    return 1.0 + expert.float() / 8.0


def _masked_experts(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """Apply the experts to ``recv_x`` `[L, R * N, H]` (local expert j of this rank is global ``rank * L + j``)."""
    scale = _scale(torch.arange(E // W) + rank * (E // W)).view(-1, 1, 1)
    return (recv_x.float() * scale).to(recv_x.dtype)


def _flat_experts(rows: torch.Tensor, token_nums: torch.Tensor, rank: int) -> torch.Tensor:
    """Apply the experts to flat rows `[A, H]` grouped by local expert (``token_nums`` `[L]` rows each)."""
    expert = torch.repeat_interleave(torch.arange(E // W), token_nums.long()) + rank * (E // W)
    out = rows.clone()
    out[: expert.numel()] = (rows[: expert.numel()].float() * _scale(expert).unsqueeze(1)).to(rows.dtype)
    return out


def _oracle(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])`` in fp32 (each expert output rounded to x's dtype)."""
    y = (x.float().unsqueeze(1) * _scale(idx).unsqueeze(2)).to(x.dtype).float()
    return (y * w.unsqueeze(2)).sum(1).to(x.dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the fp32 summation order and one bf16 rounding."""
    return bool(((a.float() - b.float()).abs() <= 1e-2 + 1e-2 * b.float().abs()).all())


def _expect_error(call, bad_here: bool, param: str) -> None:
    try:
        call()
    except MoeDistributeError as err:
        assert not bad_here or err.param == param, (param, err.param, str(err))
        return
    raise AssertionError(f"no MoeDistributeError for a bad {param} (bad on this rank: {bad_here})")


def _run_case(info, buf: Buffer, case) -> None:
    name, bad, num_tokens, v, seed = case
    target, param, _ = CASES[name]
    rank, bad_here = info.rank, info.rank in bad
    x, idx, w = _inputs(rank, num_tokens[rank], seed)
    if target == "dispatch":
        kw = {"use_fp8": False}
        args = _corrupt_dispatch(name, v, x.clone(), idx.clone(), kw) if bad_here else (x, idx, N, E)
        _expect_error(lambda: buf.low_latency_dispatch(*args, **kw), bad_here, param)
    elif target == "combine":
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        rows, kw = _masked_experts(recv_x, rank), {}
        args = _corrupt_combine(name, v, rows, idx, w, handle, kw) if bad_here else (rows, idx, w, handle)
        _expect_error(lambda: buf.low_latency_combine(*args, **kw), bad_here, param)
        out, _, _ = buf.low_latency_combine(rows, idx, w, handle)  # the dispatch's results are still usable
        assert _close(out, _oracle(x, idx, w))
    elif target != "op":
        _run_extra(info, buf, case)
    else:
        ids, world, me, num_experts, kw = idx.to(torch.int32), W, rank, E, {"global_bs": N * W}
        if bad_here:
            if name == "op_ids_range":
                ids[0, 0] = E + v
            elif name == "op_rank_id":
                me = (rank + 1) % W
            elif name == "op_world_size":
                world = W + 1 + v
            elif name == "op_quant_mode":
                kw["quant_mode"] = [1, 7, -1, 6][v]
            elif name == "op_x_dtype":
                x = x.to(torch.int32)
            elif name == "op_expert_num":
                num_experts = E + 1
        _expect_error(
            lambda: ep_ops.moe_distribute_dispatch_v2(x, ids, info.group, world, me, num_experts, **kw),
            bad_here,
            param,
        )


def _good_round(info, buf: Buffer, seed: int) -> None:
    """A valid Buffer round trip and a valid ops round trip, both against the oracle."""
    x, idx, w = _inputs(info.rank, 1 + seed % N, seed + 1)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(_masked_experts(recv_x, info.rank), idx, w, handle)
    assert _close(out, _oracle(x, idx, w))
    ids = idx.to(torch.int32)
    expand_x, _, assist, nums, counts, _, _ = ep_ops.moe_distribute_dispatch_v2(x, ids, info.group, W, info.rank, E)
    rows = _flat_experts(expand_x, nums, info.rank)
    out = ep_ops.moe_distribute_combine_v2(rows, ids, assist, counts, w, info.group, W, info.rank, E)
    assert _close(out, _oracle(x, idx, w))


def _run_extra(info, buf: Buffer, case) -> None:
    """The flat methods', combine_v2's and the two-stage ops' cases (``EXTRA`` / ``LOCAL``): corrupt what the case
    names on the bad ranks, expect the error, then finish the round validly and check it against the oracle."""
    name, bad, num_tokens, v, seed = case
    target, param, _ = CASES[name]
    g, rank, bad_here = info.group, info.rank, info.rank in bad
    x, idx, w = _inputs(rank, num_tokens[rank], seed)
    a = types.SimpleNamespace(x=x, idx=idx.clone(), ids=idx.to(torch.int32), w=w, kw={})
    gbs = {"global_bs": N * W}  # batch sizes differ across ranks
    ids = a.ids.clone()

    def corrupt() -> None:
        if bad_here:
            EXTRA[name][2](v, a)

    if target == "flat":
        corrupt()
        _expect_error(lambda: buf.low_latency_dispatch_flat(a.x, a.idx, N, E, **a.kw), bad_here, param)
    elif target == "flat_combine":
        out, _, _ = buf.low_latency_dispatch_flat(x, idx, N, E)
        a.rows, a.handle = _flat_experts(out.expand_x, out.expert_token_nums, rank), out.handle
        good = (a.rows, idx, w, a.handle)
        corrupt()
        _expect_error(lambda: buf.low_latency_combine_flat(a.rows, a.idx, a.w, a.handle, **a.kw), bad_here, param)
        assert _close(buf.low_latency_combine_flat(*good)[0], _oracle(x, idx, w))
    elif target == "op_combine":
        expand_x, _, assist, nums, counts, _, _ = ep_ops.moe_distribute_dispatch_v2(x, ids, g, W, rank, E, **gbs)
        a.rows, a.assist, a.counts = _flat_experts(expand_x, nums, rank), assist, counts
        good = (a.rows, ids, assist, counts, w, g, W, rank, E)
        corrupt()
        combine = ep_ops.moe_distribute_combine_v2
        _expect_error(
            lambda: combine(a.rows, a.ids, a.assist, a.counts, a.w, g, W, rank, E, **gbs, **a.kw), bad_here, param
        )
        assert _close(combine(*good, **gbs), _oracle(x, idx, w))
    elif target == "setup":
        corrupt()
        _expect_error(lambda: _setup_then_teardown(a, g, rank, gbs), bad_here, param)
    else:  # combine_setup, or a teardown given another call's comm_cmd_info (local: the call is redone)
        y, expand_idx, cmd = ep_ops.moe_distribute_dispatch_setup(x, ids, g, W, rank, E, **gbs)
        if name == "td_cmd" and bad_here:
            _expect_error(
                lambda: ep_ops.moe_distribute_dispatch_teardown(x, y, ids, cmd[: 16 * v + 5], g, W, rank, E, **gbs),
                True,
                param,
            )
        td = ep_ops.moe_distribute_dispatch_teardown(x, y, ids, cmd, g, W, rank, E, **gbs)
        a.rows, a.assist = _flat_experts(td[0], td[3], rank), td[2]
        good = (a.rows, ids, a.assist, g, W, rank, E)
        if target == "combine_setup":
            corrupt()
            _expect_error(lambda: _combine_setup_then_teardown(a, expand_idx, g, rank, gbs), bad_here, param)
        qx, cmd2 = ep_ops.moe_distribute_combine_setup(*good, **gbs)
        teardown = ep_ops.moe_distribute_combine_teardown
        if name == "ctd_cmd" and bad_here:  # the dispatch's key where the combine's belongs
            _expect_error(lambda: teardown(good[0], qx, ids, expand_idx, w, cmd, g, W, rank, E, **gbs), True, param)
        out = teardown(good[0], qx, ids, expand_idx, w, cmd2, g, W, rank, E, **gbs)
        assert _close(out, _oracle(x, idx, w))


def _setup_then_teardown(a, g, rank: int, gbs: dict) -> None:
    """A two-stage dispatch: a peer's rejection may surface in setup or, if the send phase does not wait for the
    peers' agreement, in teardown (either way on every rank)."""
    y, _, cmd = ep_ops.moe_distribute_dispatch_setup(a.x, a.ids, g, W, rank, E, **gbs, **a.kw)
    ep_ops.moe_distribute_dispatch_teardown(a.x, y, a.ids, cmd, g, W, rank, E, **gbs)


def _combine_setup_then_teardown(a, expand_idx, g, rank: int, gbs: dict) -> None:
    """A two-stage combine, as :func:`_setup_then_teardown`."""
    qx, cmd = ep_ops.moe_distribute_combine_setup(a.rows, a.ids, a.assist, g, W, rank, E, **gbs, **a.kw)
    ep_ops.moe_distribute_combine_teardown(a.rows, qx, a.ids, expand_idx, a.w, cmd, g, W, rank, E, **gbs)


def _same_on_all_ranks(info, case) -> None:
    digest = torch.tensor([zlib.crc32(repr(case).encode())], dtype=torch.int64)
    both = [torch.empty_like(digest) for _ in range(W)]
    dist.all_gather(both, digest, group=info.group, async_op=True).wait(timeout=datetime.timedelta(seconds=10))
    assert all(int(d) == int(digest) for d in both), f"ranks drew different examples: {case}"


def _fuzz(info):
    bufs = [Buffer(info.group, timeout=10.0, transport=t) for t in ("shm", "collective")]
    seen: dict[str, int] = {}
    current = [bufs[0]]
    for i, name in enumerate(sorted(CASES)):  # every corruption kind, each with hypothesis-drawn ranks, sizes, values
        current[0] = bufs[i % 2]  # the kinds alternate between the two transports (the same on every rank)

        @lockstep(EXAMPLES_PER_CASE)
        @given(cases(name))
        def check(case):
            _same_on_all_ranks(info, case)
            seen[case[0]] = seen.get(case[0], 0) + 1
            try:
                _run_case(info, current[0], case)
            except BaseException as e:  # the first failure (the peer's error is then only the desync; pytest -s)
                print("FAIL", info.rank, case, repr(e)[:400], flush=True)
                raise
            _good_round(info, current[0], case[4])

        check()
    return seen


def test_fuzz_bad_inputs_raise_on_every_rank_and_the_group_stays_usable():
    seen = parallel_launch(W, _fuzz, timeout=240)
    assert seen[0] == seen[1]
    assert set(seen[0]) == set(CASES) and min(seen[0].values()) >= 2, seen[0]
