"""Dispatch -> experts -> combine on 1, 2 and 4 gloo ranks, compared with the single-process oracle (ops_oracle).

Each launch runs a batch of random cases (shapes, uneven batch sizes with global_bs, empty ranks, 1D / 2D masks,
both expert_token_nums_type, quant on/off with and without smooth scales, bf16 / fp16 / fp32, expert_scales,
shared_expert_x, setup/teardown vs one-shot). Every output tensor is compared exactly, padding included.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support import ops_oracle as oracle
from tests.support.distributed import parallel_launch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_case(seed: int, world_size: int, **force) -> dict:
    """A random case: per-rank inputs plus the op keywords. ``force`` overrides any drawn choice."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    c = dict(
        dtype=rng.choice(DTYPES),
        hidden=rng.choice([8, 16, 24, 64]),
        local=rng.choice([1, 2, 3]),
        topk=rng.choice([1, 2, 3, 4]),
        uneven=rng.random() < 0.5,
        empty_rank=rng.random() < 0.3,
        mask=rng.choice([None, "1d", "2d"]),
        ent_type=rng.choice([0, 1]),
        quant=rng.random() < 0.4,
        smooth=rng.random() < 0.5,
        weights=rng.random() < 0.5,
        shared_x=rng.random() < 0.4,
        two_stage=rng.random() < 0.5,
        max_bs=rng.choice([1, 3, 5, 8]),
    )
    c.update(force)
    num_experts = c["local"] * world_size
    topk = min(c["topk"], num_experts)
    inputs = []
    for r in range(world_size):
        bs = c["max_bs"]
        if c["uneven"]:
            bs = rng.randint(0, c["max_bs"])
        if c["empty_rank"] and r == world_size - 1:
            bs = 0
        x = (torch.randn((bs, c["hidden"]), generator=g) * 2).to(c["dtype"])
        if bs:  # row 0: amax 127 and halves, so int8 quantization (scale 1) hits .5 ties: rint is half-to-even
            halves = [rng.choice((-1, 1)) * (rng.randint(0, 60) + 0.5) for _ in range(c["hidden"] - 1)]
            x[0] = torch.tensor([127.0, *halves]).to(c["dtype"])
        inputs.append(oracle.random_rank_input(x, num_experts, topk, c["mask"], c["shared_x"], rng, g))
    smooth = None
    if c["quant"] and c["smooth"]:
        smooth = torch.rand((num_experts, c["hidden"]), generator=g) + 0.5
    global_bs = c["max_bs"] * world_size if (c["uneven"] or c["empty_rank"]) else 0
    return dict(c, inputs=inputs, smooth=smooth, num_experts=num_experts, topk=topk, global_bs=global_bs)


def _expert_outputs(rank: int, world_size: int, case: dict, expand_x, dyn, token_nums) -> torch.Tensor:
    """What the test's experts return for dispatch's rows (row i of local expert j -> oracle.expert_fn(row, e))."""
    counts = token_nums if case["ent_type"] == 1 else torch.diff(token_nums, prepend=token_nums.new_zeros(1))
    experts = torch.repeat_interleave(torch.arange(counts.numel()) + rank * case["local"], counts)
    n = int(counts.sum())
    rows = expand_x[:n]
    if case["quant"]:
        rows = (rows.float() * dyn[:n].unsqueeze(1)).to(case["dtype"])
    out = torch.zeros((expand_x.shape[0], expand_x.shape[1]), dtype=case["dtype"])
    out[:n] = oracle.expert_fn(rows, experts)
    return out


def _run_static(info, cases: bytes):
    """:func:`_run_cases` with the value checks off and the torch code: the ops' static round, no host read
    (:mod:`deep_ep_npu.engine.static_flat`; smooth scales take the host plan)."""
    import os

    from deep_ep_npu import envs, kernels

    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = "0"
    envs.check_values.cache_clear()  # (read once per process)
    with kernels.disabled():
        return _run_cases(info, cases)


def _run_static_small_bound(info, cases: bytes):
    """:func:`_run_static` with the gloo receives posted at 2 KiB per peer: a call whose static message does not fit
    takes the exchange (which spills), so every case still matches the oracle."""
    from deep_ep_npu.engine.exchange import engine_for

    engine_for(info.group).collective.early_bytes = 2048
    return _run_static(info, cases)


def _run_cases(info, cases: bytes):
    """Run every case (serialized with ``to_bytes``: tensors as bytes, not shared-memory handles) on this rank."""
    from deep_ep_npu.ops import (
        moe_distribute_combine_start,
        moe_distribute_combine_v2,
        moe_distribute_dispatch_start,
        moe_distribute_dispatch_v2,
    )

    results = []
    for case in oracle.from_bytes(cases):
        inp = case["inputs"][info.rank]
        common = dict(global_bs=case["global_bs"], x_active_mask=inp.mask)
        group = info.group.group_name if case["two_stage"] else info.group  # a ProcessGroup or its name
        args = (group, info.world_size, info.rank, case["num_experts"])
        dkw = dict(
            common,
            quant_mode=2 if case["quant"] else 0,
            scales=case["smooth"],
            expert_scales=inp.weights if case["weights"] else None,
            expert_token_nums_type=case["ent_type"],
        )
        if case["two_stage"]:
            handle = moe_distribute_dispatch_start(inp.x, inp.ids, *args, **dkw)
            _ = oracle.expert_fn(inp.x, 0)  # compute between the send and the receive
            outs = handle.wait()
            assert handle.wait() is outs
            again = moe_distribute_dispatch_v2(inp.x, inp.ids, *args, **dkw)  # the one-shot form, same inputs
            assert all(torch.equal(a, b) for a, b in zip(outs, again, strict=True))
        else:
            outs = moe_distribute_dispatch_v2(inp.x, inp.ids, *args, **dkw)
        expand_x, dyn, assist, token_nums, recv_counts, _, expand_scales = outs
        y = _expert_outputs(info.rank, info.world_size, case, expand_x, dyn, token_nums)
        ckw = dict(common, shared_expert_x=inp.shared_x, expand_scales=expand_scales)
        cargs = (y, inp.ids, assist, recv_counts, inp.weights, *args)
        if case["two_stage"]:
            combined = moe_distribute_combine_start(*cargs, **ckw).wait()
            assert torch.equal(combined, moe_distribute_combine_v2(*cargs, **ckw))
        else:
            combined = moe_distribute_combine_v2(*cargs, **ckw)
        results.append((outs, combined))
    return oracle.to_bytes(results)


def check_cases(world_size: int, cases: list[dict], run=_run_cases) -> None:
    results = [oracle.from_bytes(b) for b in parallel_launch(world_size, run, oracle.to_bytes(cases), timeout=90)]
    for i, case in enumerate(cases):
        lay = oracle.Layout(world_size, case["num_experts"])
        smooth = case["smooth"]
        want = oracle.dispatch_oracle(
            case["inputs"],
            lay,
            global_bs=case["global_bs"],
            quant=case["quant"],
            smooth=smooth,
            expert_token_nums_type=case["ent_type"],
        )
        want_y = oracle.combine_oracle(case["inputs"], lay, quant=case["quant"], smooth=smooth)
        for r in range(world_size):
            outs, combined = results[r][i]
            got = dict(zip(oracle.DISPATCH_OUTPUTS, outs, strict=True))
            exp = want[r]
            ctx = f"case {i} rank {r}: {_describe(case)}"
            assert got["tp_recv_counts"].shape == (0,), ctx
            if not case["weights"]:
                assert got["expand_scales"].shape == (0,), ctx
                exp = dict(exp, expand_scales=torch.empty((0,), dtype=torch.float32))
            if not case["quant"]:
                exp = dict(exp, dynamic_scales=torch.zeros_like(exp["dynamic_scales"]))
            for key in oracle.DISPATCH_OUTPUTS:
                if key == "tp_recv_counts":
                    continue
                assert got[key].dtype == exp[key].dtype, f"{ctx}: {key} dtype {got[key].dtype} != {exp[key].dtype}"
                assert got[key].shape == exp[key].shape, f"{ctx}: {key} shape {got[key].shape} != {exp[key].shape}"
                assert torch.equal(got[key], exp[key]), f"{ctx}: {key} differs\n{got[key]}\n{exp[key]}"
            assert combined.dtype == case["dtype"] and combined.shape == case["inputs"][r].x.shape, ctx
            assert torch.equal(combined, want_y[r]), f"{ctx}: combine differs\n{combined}\n{want_y[r]}"


def _describe(case: dict) -> str:
    skip = ("inputs", "smooth")
    return ", ".join(f"{k}={v}" for k, v in case.items() if k not in skip)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_random_cases_match_oracle(world_size):
    cases = [make_case(1000 * world_size + i, world_size) for i in range(30)]
    check_cases(world_size, cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_static_round_matches_oracle(world_size):
    """The same random cases on the static round (checks off, the torch code): bit-identical to the oracle."""
    cases = [make_case(3000 * world_size + i, world_size, smooth=False) for i in range(20)]
    check_cases(world_size, cases, _run_static)


def test_static_round_falls_back_when_its_message_does_not_fit():
    cases = [make_case(5000 + i, 2, smooth=False) for i in range(12)]
    check_cases(2, cases, _run_static_small_bound)


def test_feature_grid_two_ranks():
    """Every dtype x mask kind x quant setting at least once, with uneven batches and an empty rank."""
    cases = []
    seed = 0
    for dtype in DTYPES:
        for mask in (None, "1d", "2d"):
            for quant, smooth in ((False, False), (True, False), (True, True)):
                seed += 1
                cases.append(
                    make_case(
                        seed,
                        2,
                        dtype=dtype,
                        mask=mask,
                        quant=quant,
                        smooth=smooth,
                        uneven=seed % 2 == 0,
                        empty_rank=seed % 3 == 0,
                        ent_type=seed % 2,
                        weights=True,
                        shared_x=seed % 2 == 1,
                        two_stage=seed % 4 == 0,
                    )
                )
    check_cases(2, cases)


def test_every_rank_empty():
    """All ranks with zero tokens still take part; every output is empty or zero."""
    cases = [make_case(7, 2, max_bs=0, uneven=False, empty_rank=False, mask=None)]
    cases[0]["global_bs"] = 2
    check_cases(2, cases)
