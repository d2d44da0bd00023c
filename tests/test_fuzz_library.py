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
import zlib

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deep_ep_npu import Buffer, MoeDistributeError
from deep_ep_npu import ops as ep_ops
from tests.distributed import parallel_launch

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
    "logfmt": ("combine", "use_logfmt", False),
    "other_topk": ("combine", "handle", True),
    "op_ids_range": ("op", "expert_ids", False),
    "op_rank_id": ("op", "ep_rank_id", False),
    "op_world_size": ("op", "ep_world_size", False),
    "op_quant_mode": ("op", "quant_mode", False),
    "op_x_dtype": ("op", "x", False),
    "op_expert_num": ("op", "moe_expert_num", False),
}


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
    elif name == "logfmt":
        kw["use_logfmt"] = True
    elif name == "other_topk":
        idx = idx.clone()
        idx[0] = -1  # routes fewer tokens than the dispatch did: the handle no longer matches
    return recv_x, idx, w, handle


def _oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.float() - b.float()).abs() <= 2e-2 + 2e-2 * b.float().abs()).all())


def _expect_error(call, bad_here: bool, param: str) -> None:
    try:
        call()
    except MoeDistributeError as err:
        assert not bad_here or err.param == param or param in str(err), (param, str(err))
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
        kw: dict = {}
        args = _corrupt_combine(name, v, recv_x, idx, w, handle, kw) if bad_here else (recv_x, idx, w, handle)
        _expect_error(lambda: buf.low_latency_combine(*args, **kw), bad_here, param)
        out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)  # the dispatch's results are still usable
        assert _close(out, _oracle(x, w))
    else:
        ids, world, me, num_experts, kw = idx.to(torch.int32), W, rank, E, {}
        if bad_here:
            if name == "op_ids_range":
                ids[0, 0] = E + v
            elif name == "op_rank_id":
                me = (rank + 1) % W
            elif name == "op_world_size":
                world = W + 1 + v
            elif name == "op_quant_mode":
                kw["quant_mode"] = [1, 3, -1, 4][v]
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
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    assert _close(out, _oracle(x, w))
    ids = idx.to(torch.int32)
    expand_x, _, assist, _, counts, _, _ = ep_ops.moe_distribute_dispatch_v2(x, ids, info.group, W, info.rank, E)
    out = ep_ops.moe_distribute_combine_v2(expand_x, ids, assist, counts, w, info.group, W, info.rank, E)
    assert _close(out, _oracle(x, w))


def _same_on_all_ranks(info, case) -> None:
    digest = torch.tensor([zlib.crc32(repr(case).encode())], dtype=torch.int64)
    both = [torch.empty_like(digest) for _ in range(W)]
    dist.all_gather(both, digest, group=info.group, async_op=True).wait(timeout=datetime.timedelta(seconds=10))
    assert all(int(d) == int(digest) for d in both), f"ranks drew different examples: {case}"


def _fuzz(info):
    buf = Buffer(info.group, timeout=10.0)
    seen: dict[str, int] = {}
    for name in sorted(CASES):  # every corruption kind, each with hypothesis-drawn ranks, sizes and values

        @settings(
            max_examples=EXAMPLES_PER_CASE,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(cases(name))
        def check(case):
            _same_on_all_ranks(info, case)
            seen[case[0]] = seen.get(case[0], 0) + 1
            _run_case(info, buf, case)
            _good_round(info, buf, case[4])

        check()
    return seen


def test_fuzz_bad_inputs_raise_on_every_rank_and_the_group_stays_usable():
    seen = parallel_launch(W, _fuzz, timeout=240)
    assert seen[0] == seen[1]
    assert set(seen[0]) == set(CASES) and min(seen[0].values()) >= 2, seen[0]
