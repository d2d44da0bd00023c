"""torch_npu's real two-stage ops (``moe_distribute_{dispatch,combine}_{setup,teardown}``) on 2 and 4 gloo ranks.

Each flow runs setup -> teardown -> experts -> combine setup -> teardown and, on the same inputs, the one-shot
``_v2`` ops; outputs are compared exactly with each other and with the single-process oracle (``ops_oracle``), and
``y`` / ``expand_idx`` with a golden written here from the documented layout. Then the error contract: bad input
fails on every rank with the one-shot ops' codes, and a teardown given the wrong ``comm_cmd_info`` is a clear error.
"""

from __future__ import annotations

import random

import pytest
import torch

from deep_ep_npu import ops
from deep_ep_npu.errors import MoeDistributeError
from tests.support.distributed import parallel_launch
from tests.support.ops_oracle import Layout, RankInput, combine_oracle, dispatch_oracle, expert_fn, quant_int8


def _inputs(case: dict, world_size: int) -> tuple[list[RankInput], torch.Tensor | None]:
    """Every rank's inputs (seeded), and the smooth scales `[E, H]` (or None)."""
    g, rng = torch.Generator().manual_seed(case["seed"]), random.Random(case["seed"])
    e, hidden, topk = case["local"] * world_size, case["hidden"], case["topk"]
    out = []
    for _ in range(world_size):
        bs = rng.randint(1, case["max_bs"]) if case["uneven"] else case["max_bs"]
        x = torch.randn((bs, hidden), generator=g).to(case["dtype"])
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(bs)]).to(torch.int32)
        mask = torch.arange(bs) < rng.randint(0, bs) if case["mask"] else None
        out.append(RankInput(x, ids, mask, torch.rand((bs, topk), generator=g)))
    smooth = torch.rand((e, hidden), generator=g) + 0.5 if case["smooth"] else None
    return out, smooth


def _experts(expand_x: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, rank: int, quant: bool, dtype):
    """Apply ``expert_fn`` to the received rows (local expert j of this rank is global ``rank * L + j``)."""
    num_local = counts.numel()
    rows = expand_x.float() * scales.unsqueeze(1) if quant else expand_x
    expert = torch.repeat_interleave(torch.arange(num_local), counts, output_size=int(counts.sum()))
    expert = torch.cat([expert, torch.full((rows.shape[0] - expert.numel(),), num_local - 1)]) + rank * num_local
    return expert_fn(rows.to(dtype), expert)


def _flow(info, case: dict) -> dict:
    w, rank = info.world_size, info.rank
    inputs, smooth = _inputs(case, w)
    inp, e, quant = inputs[rank], case["local"] * w, case["quant"]
    gbs = case["max_bs"] * w if case["uneven"] else 0
    name = info.group.group_name
    shared = dict(global_bs=gbs)
    dkw = dict(shared, quant_mode=2 if quant else 0, scales=smooth, x_active_mask=inp.mask)
    y, expand_idx, cmd = ops.moe_distribute_dispatch_setup(
        inp.x, inp.ids, name, w, rank, e, **dkw, y_dtype=torch.int8 if quant else None
    )
    tkw = dict(shared, quant_mode=dkw["quant_mode"], expert_token_nums_type=case["ent"])
    td = ops.moe_distribute_dispatch_teardown(inp.x, y, inp.ids, cmd, name, w, rank, e, **tkw)
    counts = td[3].diff(prepend=td[3].new_zeros(1)) if case["ent"] == 0 and td[3].numel() > 1 else td[3]
    out_rows = _experts(td[0], td[1], counts, rank, quant, inp.x.dtype)
    qx, cmd2 = ops.moe_distribute_combine_setup(out_rows, inp.ids, td[2], name, w, rank, e, **shared)
    combined = ops.moe_distribute_combine_teardown(
        out_rows, qx, inp.ids, expand_idx, inp.weights, cmd2, name, w, rank, e, x_active_mask=inp.mask, **shared
    )
    one = ops.moe_distribute_dispatch_v2(
        inp.x, inp.ids, info.group, w, rank, e, **dkw, expert_token_nums_type=case["ent"]
    )
    one_combined = ops.moe_distribute_combine_v2(
        _experts(one[0], one[1], counts, rank, quant, inp.x.dtype),
        inp.ids,
        one[2],
        one[4],
        inp.weights,
        info.group,
        w,
        rank,
        e,
        x_active_mask=inp.mask,
        **shared,
    )
    return dict(
        y=y,
        expand_idx=expand_idx,
        cmd=cmd,
        teardown=td,
        qx=qx,
        cmd2=cmd2,
        combined=combined,
        one=one,
        one_combined=one_combined,
    )


def _golden_y(inp: RankInput, e: int, quant: bool, smooth: torch.Tensor | None, hs: int) -> tuple:
    """``y`` / ``expand_idx`` by the documented layout: sent pairs stable-sorted by expert id; the occurrence index."""
    bs, k = inp.ids.shape
    active = int(inp.mask.sum()) if inp.mask is not None else bs
    pairs = sorted((int(inp.ids[t, j]), t * k + j) for t in range(active) for j in range(k))
    idx, seen = torch.full((bs * k,), -1, dtype=torch.int32), {}
    y = torch.zeros((bs * (k + 1), hs), dtype=torch.int8 if quant else inp.x.dtype)
    for i, (expert, flat) in enumerate(pairs):
        idx[flat], seen[expert] = seen.get(expert, 0), seen.get(expert, 0) + 1
        row = inp.x[flat // k]
        if quant:
            q, scale = quant_int8(row.unsqueeze(0), None if smooth is None else smooth[expert])
            y[i, : row.numel()] = torch.from_numpy(q.reshape(-1))
            at = -(-row.numel() // 32) * 32
            y[i].view(torch.uint8)[at : at + 4] = torch.tensor([float(scale)], dtype=torch.float32).view(torch.uint8)
        else:
            y[i, : row.numel()] = row
    return y, idx


_FIELDS = ("seed", "dtype", "hidden", "local", "topk", "max_bs", "uneven", "mask", "quant", "smooth", "ent")
CASES = [
    dict(zip(_FIELDS, row, strict=True))
    for row in (
        (1, torch.bfloat16, 64, 2, 3, 5, False, False, False, False, 1),
        (2, torch.float16, 40, 1, 2, 4, True, True, True, True, 0),
        (3, torch.float32, 32, 3, 4, 6, True, False, True, False, 0),
    )
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_stage_equals_one_shot_and_oracle(world_size):
    for case in CASES:
        results = parallel_launch(world_size, _flow, case)
        inputs, smooth = _inputs(case, world_size)
        e, quant = case["local"] * world_size, case["quant"]
        lay = Layout(world_size, e)
        gbs = case["max_bs"] * world_size if case["uneven"] else 0
        want = dispatch_oracle(
            inputs, lay, global_bs=gbs, quant=quant, smooth=smooth, expert_token_nums_type=case["ent"]
        )
        want_x = combine_oracle(inputs, lay, quant=quant, smooth=smooth)
        for rank, got in enumerate(results):
            inp, (expand_x, scales, assist, counts) = inputs[rank], got["teardown"]
            bs, k, h, cap = *inp.ids.shape, case["hidden"], want[rank]["expand_x"].shape[0]
            hs = -(-(-(-h // 32) * 32 + 4) // 512) * 512 if quant else -(-h // 256) * 256
            y, idx = _golden_y(inp, e, quant, smooth, hs)
            assert torch.equal(got["y"], y) and torch.equal(got["expand_idx"], idx), (case, rank)
            assert got["cmd"].shape == ((bs * (k + 1) + e) * 16,) and got["cmd"].dtype == torch.int32
            assert torch.equal(expand_x, want[rank]["expand_x"]) and torch.equal(expand_x, got["one"][0])
            assert torch.equal(scales, want[rank]["dynamic_scales"] if quant else torch.zeros(cap))
            assert torch.equal(counts, want[rank]["expert_token_nums"]) and torch.equal(counts, got["one"][3])
            assert assist.shape == (cap * 128,) and assist.dtype == torch.int32
            assert torch.equal(assist[:e], want[rank]["ep_recv_counts"][:e]) and not assist[e:].any()
            qx_cols = -(-(-(-h // 32) * 32 + -(-h // 8) * 8 // 8 * 4) // 512) * 512
            assert got["qx"].shape == (cap, qx_cols) and got["qx"].dtype == torch.int8
            assert got["cmd2"].shape == ((cap + world_size) * 16,)
            assert torch.equal(got["combined"], got["one_combined"]), (case, rank)
            assert torch.equal(got["combined"], want_x[rank]), (case, rank)


def _errors(info) -> dict:
    w, rank, name, e = info.world_size, info.rank, info.group.group_name, 2 * info.world_size
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((3, 16), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(3)]).to(torch.int32)
    seen = {}

    def expect(key: str, fn) -> None:
        try:
            fn()
        except MoeDistributeError as err:
            seen[key] = (err.code, err.param, str(err))
        else:
            seen[key] = None

    setup = ops.moe_distribute_dispatch_setup
    expect("comm_type", lambda: setup(x, ids, name, w, rank, e, comm_type=3 if rank == 1 else 0))
    expect("y_dtype", lambda: setup(x, ids, name, w, rank, e, quant_mode=2 if rank == 0 else 0))
    bad_ids = ids.clone()
    bad_ids[0, 0] = e + 5 if rank == 1 else bad_ids[0, 0]
    expect("expert_ids", lambda: setup(x, bad_ids, name, w, rank, e))
    expect("shared", lambda: setup(x, ids, name, w, rank, e, shared_expert_rank_num=1))
    x_big = torch.zeros((3, 1024), dtype=torch.bfloat16)
    expect("strict_urma", lambda: setup(x_big, ids, name, w, rank, e, strict="a5"))
    expect("strict_a3", lambda: setup(x_big, ids, name, w, rank, e, strict=True, comm_type=2))
    expect("strict_h", lambda: setup(x, ids, name, w, rank, e, strict="a5", comm_type=2))
    expect("unknown_group", lambda: setup(x, ids, "no_such_group", w, rank, e))
    # two calls in flight; a teardown with the other call's comm_cmd_info, then both in reverse order
    y1, _, cmd1 = setup(x, ids, name, w, rank, e)
    y2, idx2, cmd2 = setup(x2 := x * 2, ids, name, w, rank, e)
    teardown = ops.moe_distribute_dispatch_teardown
    expect("other_call", lambda: teardown(x2, y2, ids, cmd1, name, w, rank, e))
    expect("other_args", lambda: teardown(x, y1, ids, cmd1, name, w, rank, e, global_bs=4 * w))
    expect("garbage", lambda: teardown(x, y1, ids, torch.arange(64, dtype=torch.int32), name, w, rank, e))
    out2 = teardown(x2, y2, ids, cmd2, name, w, rank, e)
    teardown(x, y1, ids, cmd1, name, w, rank, e)
    expect("stale", lambda: teardown(x, y1, ids, cmd1, name, w, rank, e))
    rows = out2[0].clone()
    qx, ccmd = ops.moe_distribute_combine_setup(rows, ids, out2[2], name, w, rank, e)
    expect("wrong_kind", lambda: teardown(x, y1, ids, ccmd, name, w, rank, e))
    expect(
        "combine_quant",
        lambda: ops.moe_distribute_combine_setup(
            rows, ids, out2[2], name, w, rank, e, comm_quant_mode=2 if rank else 0
        ),
    )
    expect(
        "combine_gbs", lambda: ops.moe_distribute_combine_setup(rows, ids, out2[2], name, w, rank, e, global_bs=2 * w)
    )
    weights = torch.ones((3, 2))
    comb_teardown = ops.moe_distribute_combine_teardown
    bad_idx = idx2.clone()
    bad_idx[0] = 50
    expect("idx", lambda: comb_teardown(rows, qx, ids, bad_idx, weights, ccmd, name, w, rank, e))
    seen["result"] = comb_teardown(rows, qx, ids, idx2, weights, ccmd, name, w, rank, e)
    seen["want"] = (x * 2).float().mul(2).to(torch.bfloat16)  # each pair returns its token's row; weights 1, K = 2
    return seen


def test_two_stage_errors():
    results = parallel_launch(2, _errors)
    for rank, seen in enumerate(results):
        assert seen["comm_type"][0] == 161002 and (rank == 0 or seen["comm_type"][1] == "comm_type")
        assert seen["y_dtype"][0] == 161001 and (rank == 1 or seen["y_dtype"][1] == "y_dtype")
        assert seen["expert_ids"][0] == 561002
        own = seen["expert_ids"][1] == "expert_ids"
        assert ("aborted on every rank" in seen["expert_ids"][2]) if rank == 0 else own
        assert seen["shared"][1] == "shared_expert_rank_num" and "no shared experts" in seen["shared"][2]
        assert seen["strict_urma"][1] == "comm_type" and "URMA" in seen["strict_urma"][2]
        assert "[1024, 8192]" in seen["strict_h"][2]
        assert seen["strict_a3"][1] == "strict" and "Ascend 950 only" in seen["strict_a3"][2]
        assert seen["unknown_group"][1] == "group_ep" and "known" in seen["unknown_group"][2]
        assert seen["other_call"][1] == "y" and "call #" in seen["other_call"][2]
        assert seen["other_args"][1] == "global_bs"
        assert seen["garbage"][1] == "comm_cmd_info" and "is not the comm_cmd_info" in seen["garbage"][2]
        assert "no longer in flight" in seen["stale"][2]
        assert "moe_distribute_combine_setup" in seen["wrong_kind"][2]
        assert seen["combine_quant"][0] == 161002
        assert seen["combine_gbs"][:2] == (561002, "global_bs")  # 4 on every rank: 4 / W < Bs 3
        assert "4 / W = 2 is below this rank's Bs 3" in seen["combine_gbs"][2]
        assert seen["idx"][1] == "expand_idx"
        assert torch.equal(seen["result"], seen["want"])


def _dequant(q: torch.Tensor, scales: torch.Tensor, mode: int) -> torch.Tensor:
    """Written from the documented formats: mode 2 one fp32 scale per row, 3 one per 128 channels, 4 e8m0 per 32."""
    n, h = q.shape
    if mode == 2:
        return q.float() * scales.reshape(n, 1)
    group = 128 if mode == 3 else 32
    s = scales[:, : h // group].float() if mode == 3 else 2.0 ** (scales.view(torch.uint8)[:, : h // 32].double() - 127)
    return (q.float().view(n, h // group, group) * s.float().unsqueeze(-1)).view(n, h)


FP8_MODES = (
    (2, torch.float8_e4m3fn),
    (2, torch.float8_e5m2),
    (3, torch.float8_e4m3fn),
    (4, torch.float8_e5m2),
    (4, torch.float8_e4m3fn),
)


def _fp8_flow(info) -> list:
    """Each fp8 mode through the two-stage ops and the one-shot ops, with garbage ids outside a 1D mask."""
    w, rank, name, e, k, h = info.world_size, info.rank, info.group.group_name, 2 * info.world_size, 2, 256
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((5, h), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(5)]).to(torch.int32)
    mask = torch.arange(5) < 3 + rank
    ids[3 + rank :] = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32)  # torch.empty-style padding
    weights = torch.rand((5, k), generator=g)
    out = []
    for mode, dtype in FP8_MODES:
        kw = dict(quant_mode=mode, x_active_mask=mask)
        y, idx, cmd = ops.moe_distribute_dispatch_setup(x, ids, name, w, rank, e, **kw, y_dtype=dtype)
        ex, scales, assist, counts = ops.moe_distribute_dispatch_teardown(
            x, y, ids, cmd, name, w, rank, e, quant_mode=mode
        )
        one = ops.moe_distribute_dispatch_v2(x, ids, name, w, rank, e, **kw, y_dtype=dtype)
        rows = _dequant(ex, scales, mode).to(torch.bfloat16)
        qx, cmd2 = ops.moe_distribute_combine_setup(rows, ids, assist, name, w, rank, e)
        combined = ops.moe_distribute_combine_teardown(
            rows, qx, ids, idx, weights, cmd2, name, w, rank, e, x_active_mask=mask
        )
        one_combined = ops.moe_distribute_combine_v2(
            _dequant(one[0], one[1], mode).to(torch.bfloat16),
            ids,
            one[2],
            one[4],
            weights,
            name,
            w,
            rank,
            e,
            x_active_mask=mask,
        )
        n = int(idx.ge(0).sum())
        at = -(-h // {2: 32, 3: 128, 4: 256}[mode]) * {2: 32, 3: 128, 4: 256}[mode]
        width = {2: 4, 3: 4 * (h // 128), 4: h // 32}[mode]
        y_scales = y.view(torch.uint8)[:n, at : at + width]
        y_scales = y_scales.view(torch.float32) if mode < 4 else y_scales.view(torch.float8_e8m0fnu)
        y_rows = _dequant(y[:n, :h], y_scales, mode)
        order = sorted(range(int(mask.sum()) * k), key=lambda f: int(ids.view(-1)[f]))  # stable sort by expert
        want_rows = x.float()[torch.tensor([f // k for f in order], dtype=torch.long)]
        out.append(
            dict(
                same=torch.equal(ex.view(torch.uint8), one[0].view(torch.uint8))
                and torch.equal(counts, one[3])
                and torch.equal(scales.view(torch.uint8), one[1].view(torch.uint8))
                and torch.equal(combined, one_combined),
                y_err=float(((y_rows - want_rows).abs() / want_rows.abs().amax(dim=1, keepdim=True)).max()),
                y_dtype=y.dtype,
                scales_dtype=scales.dtype,
                scales_shape=tuple(scales.shape),
                cap=ex.shape[0],
            )
        )
    return out


def test_two_stage_fp8_modes_with_garbage_padding():
    for rank, results in enumerate(parallel_launch(2, _fp8_flow)):
        for (mode, dtype), got in zip(FP8_MODES, results, strict=True):
            assert got["same"], (rank, mode, dtype)
            assert got["y_dtype"] == dtype and got["y_err"] <= (2**-3 if dtype == torch.float8_e5m2 else 2**-4)
            cap = got["cap"]
            want = {2: ((cap,), torch.float32), 3: ((cap, 2), torch.float32), 4: ((cap, 8), torch.float8_e8m0fnu)}[mode]
            assert (got["scales_shape"], got["scales_dtype"]) == want
