"""The TP domain (tp_world_size 2) on 4 gloo ranks = EP 2 x TP 2, against the oracle.

Global rank ``g`` is EP rank ``g % 2`` of EP group ``g // 2`` and TP rank ``g // 2`` of TP group ``g % 2``. Each EP
group dispatches on its own; the oracle then glues each rank's own rows and its TP peer's (own first). In combine the
two TP ranks of an expert compute different partial outputs; the reduce-scatter must sum them before the EP return.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from tests.support import ops_oracle as oracle
from tests.support.distributed import error_mismatches, op_error, parallel_launch

NULL, PARAM, SHAPE = 161001, 161002, 561002


def _groups(info):
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return ep[info.rank // 2], tp[info.rank % 2]


def partial_expert(rows: torch.Tensor, e: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s half of expert e (elementwise, so batching cannot change a bit)."""
    return oracle.expert_fn(rows, e + 3 * tp_rank)


def make_case(seed: int) -> dict:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    hidden, topk, max_bs = rng.choice([8, 16]), rng.choice([1, 2]), rng.choice([1, 3, 5])
    uneven, mask_kind = rng.random() < 0.5, rng.choice([None, "1d", "2d"])
    inputs = []
    for _ in range(4):
        bs = rng.randint(0, max_bs) if uneven else max_bs
        x = (torch.randn((bs, hidden), generator=g) * 2).to(dtype)
        inputs.append(oracle.random_rank_input(x, 2, topk, mask_kind, False, rng, g))
    return dict(
        dtype=dtype,
        inputs=inputs,
        quant=rng.random() < 0.4,
        global_bs=max_bs * 2 if uneven else 0,
        ent_type=rng.choice([0, 1]),
    )


def _run(info, data: bytes):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    ep, tp = _groups(info)
    e, t = info.rank % 2, info.rank // 2
    tpkw = dict(group_tp=tp, tp_world_size=2, tp_rank_id=t)
    out = []
    for case in oracle.from_bytes(data):
        inp = case["inputs"][info.rank]
        kw = dict(x_active_mask=inp.mask, global_bs=case["global_bs"], **tpkw)
        outs = moe_distribute_dispatch_v2(
            inp.x,
            inp.ids,
            ep,
            2,
            e,
            2,
            quant_mode=2 if case["quant"] else 0,
            expert_token_nums_type=case["ent_type"],
            expert_scales=inp.weights,
            **kw,
        )
        expand_x, dyn, assist, _, counts, tp_counts, _ = outs
        n = int(tp_counts.sum())
        rows = expand_x[:n] if not case["quant"] else (expand_x[:n].float() * dyn[:n, None]).to(case["dtype"])
        y = torch.zeros((expand_x.shape[0], expand_x.shape[1]), dtype=case["dtype"])
        y[:n] = partial_expert(rows, e, t)
        combined = moe_distribute_combine_v2(
            y, inp.ids, assist, counts, inp.weights, ep.group_name, 2, e, 2, tp_send_counts=tp_counts, **kw
        )
        out.append((outs, combined))
    return oracle.to_bytes(out)


def _expected(case: dict) -> list[tuple[dict, torch.Tensor]]:
    """Per global rank: the expected dispatch outputs (TP-gathered) and combine output."""
    lay = oracle.Layout(2, 2)
    groups = [case["inputs"][0:2], case["inputs"][2:4]]
    kw = dict(quant=case["quant"], global_bs=case["global_bs"])
    disp = [oracle.dispatch_oracle(grp, lay, **kw) for grp in groups]

    def summed(t):
        def out(_src, row, e):
            if case["quant"]:
                row = combine_oracle_dequant(row)
            parts = [partial_expert(row.unsqueeze(0), e, tt)[0].float() for tt in (t, 1 - t)]
            return (parts[0] + parts[1]).to(row.dtype)

        return out

    comb = [oracle.combine_oracle(groups[t], lay, expert_out=summed(t)) for t in (0, 1)]
    result = []
    for g in range(4):
        e, t = g % 2, g // 2
        own, peer = disp[t][e], disp[1 - t][e]
        n_own, n_peer = int(own["num_rows"]), int(peer["num_rows"])
        cap = own["expand_x"].shape[0]
        exp = {}
        for key in ("expand_x", "dynamic_scales"):
            full = torch.zeros((2 * cap, *own[key].shape[1:]), dtype=own[key].dtype)
            full[:n_own] = own[key][:n_own]
            full[n_own : n_own + n_peer] = peer[key][:n_peer]
            exp[key] = full if key == "expand_x" or case["quant"] else torch.zeros_like(full)
        exp["assist_info_for_combine"] = own["assist_info_for_combine"]
        nums = torch.tensor([n_own + n_peer], dtype=torch.int64)
        exp["expert_token_nums"] = nums
        own_counts = torch.diff(own["ep_recv_counts"], prepend=torch.zeros(1, dtype=torch.int32))
        peer_counts = torch.diff(peer["ep_recv_counts"], prepend=torch.zeros(1, dtype=torch.int32))
        exp["ep_recv_counts"] = torch.cat([own_counts, peer_counts]).cumsum(0).to(torch.int32)
        tp_counts = torch.zeros(2, dtype=torch.int32)
        tp_counts[t], tp_counts[1 - t] = n_own, n_peer
        exp["tp_recv_counts"] = tp_counts
        exp["expand_scales"] = own["expand_scales"]
        result.append((exp, comb[t][e]))
    return result


def combine_oracle_dequant(row: torch.Tensor) -> torch.Tensor:
    q, sc = oracle.quant_int8(row, None)
    return (torch.from_numpy(q).float() * float(sc)).to(row.dtype)


def test_tp_dispatch_combine_match_oracle():
    cases = [make_case(i) for i in range(12)]
    results = [oracle.from_bytes(b) for b in parallel_launch(4, _run, oracle.to_bytes(cases), timeout=90)]
    for i, case in enumerate(cases):
        want = _expected(case)
        for g in range(4):
            outs, combined = results[g][i]
            exp, exp_y = want[g]
            ctx = f"case {i} rank {g} quant={case['quant']} dtype={case['dtype']} global_bs={case['global_bs']}"
            for key, got in zip(oracle.DISPATCH_OUTPUTS, outs, strict=True):
                if key == "expert_token_nums" and case["ent_type"] == 0:
                    exp[key] = exp[key].cumsum(0)
                assert got.shape == exp[key].shape, f"{ctx}: {key} shape {got.shape} != {exp[key].shape}"
                assert torch.equal(got, exp[key]), f"{ctx}: {key}\n{got}\n{exp[key]}"
            assert torch.equal(combined, exp_y), f"{ctx}: combine\n{combined}\n{exp_y}"


def _tp_errors(info):
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    ep, tp = _groups(info)
    e, t = info.rank % 2, info.rank // 2
    x, ids = torch.ones(2, 8), torch.tensor([[0], [1]], dtype=torch.int32)
    tpkw = dict(group_tp=tp, tp_world_size=2, tp_rank_id=t)

    out = {}
    out["local_experts_2"] = op_error(lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 4, **tpkw))
    out["tp_3"] = op_error(lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, group_tp=tp, tp_world_size=3))
    out["no_group_tp"] = op_error(
        lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, tp_world_size=2, tp_rank_id=t)
    )
    out["tp_rank_wrong"] = op_error(
        lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, group_tp=tp, tp_world_size=2, tp_rank_id=1 - t)
    )
    elastic = torch.tensor([0, 2, 0, 2, 0, 1, 0, 1], dtype=torch.int32)
    out["elastic_tp"] = op_error(lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, elastic_info=elastic, **tpkw))
    quant = 2 if t == 1 else 0  # each EP domain agrees; the TP pairs do not
    out["tp_disagree"] = op_error(lambda: moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, quant_mode=quant, **tpkw))
    bad_ids = ids.clone() if info.rank != 0 else torch.tensor([[0], [5]], dtype=torch.int32)
    out["rank0_bad"] = op_error(lambda: moe_distribute_dispatch_v2(x, bad_ids, ep, 2, e, 2, **tpkw))
    expand_x, _, assist, _, counts, tp_counts, _ = moe_distribute_dispatch_v2(x, ids, ep, 2, e, 2, **tpkw)
    w = torch.ones(2, 1)
    args = (expand_x, ids, assist, counts, w, ep, 2, e, 2)
    out["comm_quant"] = op_error(
        lambda: moe_distribute_combine_v2(*args, tp_send_counts=tp_counts, comm_quant_mode=2, **tpkw)
    )
    out["no_tp_counts"] = op_error(lambda: moe_distribute_combine_v2(*args, **tpkw))
    y = moe_distribute_combine_v2(*args, tp_send_counts=tp_counts, **tpkw)  # identity experts on both TP ranks
    out["ok"] = torch.equal(y, 2 * x)
    return out


def test_tp_validation_on_every_rank():
    results = parallel_launch(4, _tp_errors, timeout=60)
    expect = {
        "local_experts_2": (SHAPE, "moe_expert_num", "exactly 1"),
        "tp_3": (PARAM, "tp_world_size", "3"),
        "no_group_tp": (NULL, "group_tp", "None"),
        "tp_rank_wrong": (SHAPE, "tp_rank_id", "group_tp"),
        "elastic_tp": (PARAM, "elastic_info", "tp_world_size"),
        "comm_quant": (PARAM, "comm_quant_mode", "tp_world_size 2"),
        "no_tp_counts": (NULL, "tp_send_counts", "None"),
        "tp_disagree": (SHAPE, "dtype / quant", "TP pair disagrees"),
    }
    for g, got in enumerate(results):
        assert got.pop("ok") is True
        bad = error_mismatches(g, got, expect)
        assert not bad, "\n".join(bad)
        # rank 0's bad id: its EP group raises from the header, the other EP group from the TP status exchange
        code, param, msg = got["rank0_bad"]
        assert code == SHAPE, got["rank0_bad"]
        assert param == ("expert_ids" if g == 0 else "inputs"), got["rank0_bad"]
