"""The call patterns of the engines that use torch_npu's MoE distribute ops, replayed on the NPU stand-in (``torch_npu =
sim.install()`` in every gloo rank) with their exact keywords (vllm-ascend's ``token_dispatcher.py``, sgl-kernel-npu),
against goldens written here (``tests/support/npu_golden.py``: init-routing sort, the documented quant formulas, fp32
sums).

- vllm-ascend ``TokenDispatcherWithMC2`` (A3): the group named by ``device_group._get_backend(torch.device("npu"))
  .get_hccl_comm_name(local_rank)``; dispatch ``x, expert_ids, expert_shard_type=0, shared_expert_rank_num=0,
  moe_expert_num, global_bs, expert_token_nums_type`` (0 cumsum / 1 counts, used as the GMM ``group_list`` with that
  ``group_list_type``), ``x_active_mask=mc2_mask`` only when global_bs is 0 (hidden states zero-padded to the
  largest DP batch, padded rows routed by all-zero logits, the mask True for the real prefix), else ``global_bs =
  (capacity // tp) * W`` with uneven batches and no mask; ``scales=None, quant_mode`` 0 / 2, ``group_ep``, W, rank,
  ``group_tp=<same name>, tp_world_size=1, tp_rank_id=0``. Combine: ``expand_x, expert_ids, expert_scales=
  topk_weights.float32``, shard / SR 0, E, global_bs, the mask, ``ep_send_counts=ep_recv_counts``, ``expand_scales``,
  ``comm_quant_mode=0``, ``assist_info_for_combine``, ``tp_send_counts`` (``torch.empty(1, int32)`` when dispatch
  quantized), ``group_tp``, tp 1 / 0. Checked exactly: expand_x / dynamic_scales / assist triples / counts and the
  combined x.
- vllm-ascend A5: ``quant_mode=4, y_dtype=torch.float8_e4m3fn, expert_scales``; the GMM's per-token scales are
  dynamic_scales as e8m0; combine ``comm_quant_mode=4`` (MX e4m3 on the wire), checked within the MX bound (half an
  e4m3 step of the block scale, or the saturation at 448, plus the bf16 roundings) and that it did quantize; the same
  call under ``strict="a3"`` is refused naming both platforms.
- vllm-ascend hierarchy: ``HCCL_INTRA_ROCE_ENABLE=0`` + ``HCCL_INTRA_PCIE_ENABLE=1`` turn on ``comm_alg="hierarchy"``
  and ``expert_scales``; the layout is opaque on the NPU, so what callers rely on is checked: rows grouped per local
  expert (as multisets) with ``expert_token_nums`` counts, and the combined x exactly. Without ``expert_scales`` it is
  refused (161001 naming it).
- sgl-kernel-npu "ops" strategy (``low_latency_strategy.py`` @f425bdf): the group named with ``group.rank()``; x, topk
  and weights padded to ``num_max_dispatch_tokens_per_rank`` with ``torch.empty``-style garbage (here deliberately
  huge, negative and duplicate ids, NaN / inf values) and a 1D prefix ``x_active_mask``; dispatch ``scales=None,
  x_active_mask, expert_scales=<padded weights>, performance_info=None, expert_shard_type=0, shared_expert_num=0,
  shared_expert_rank_num=$MOE_SHARED_EXPERT_RANK_NUM (0), quant_mode`` 0 / 2 (3, for ``use_ue8m0``, is refused: it
  needs an fp8 ``y_dtype``), ``expert_token_nums_type=$MOE_EXPERT_TOKEN_NUMS_TYPE (1), comm_alg`` "hierarchy"
  (its default), "ccu", "fullmesh_v2", ""; no tp / global_bs; combine ``tp_send_counts=None, x_active_mask,
  expand_scales, shared_expert_x=None, comm_quant_mode=0``, output sliced ``[:n]``. Its A5 baseline
  (``test_fused_deep_moe_a5.py``): zero padding + mask, ``quant_mode=4``, y_dtype e4m3 / e5m2 (fp4 is refused naming
  y_dtype), ``group_tp="", tp 1 / 0, shared_expert_num=1, shared_expert_rank_num=0, global_bs,
  expert_token_nums_type=1``, scales viewed ``(..., -1, 2)`` as e8m0 before the GMM; combine exactly.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import sim
from tests.support.distributed import op_error, parallel_launch
from tests.support.npu_golden import expert_ffn, mx_dequant, quant_mx, quant_per_token, weighted_sum

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu exists")

HIDDEN, TOPK, LOCAL = 64, 3, 2  # H (two MX blocks), K, experts per rank
DTYPE = torch.bfloat16


# --- what the callers do around the ops (rank side) ----------------------------------------------------------------


def _grouped_experts(hidden_states, dynamic_scale, group_list, group_list_type: int, first_expert: int, quant: str):
    """The GMM the callers run: rows grouped per local expert by ``group_list`` (0: cumsum, 1: counts), dequantized
    with ``dynamic_scale`` (int8: per row; mx: e8m0 per 32), then ``expert_ffn`` of the global expert."""
    counts = group_list.diff(prepend=group_list.new_zeros(1)) if group_list_type == 0 else group_list
    n = int(counts.sum())
    rows = hidden_states[:n]
    if quant == "int8":
        rows = (rows.float() * dynamic_scale[:n].unsqueeze(1)).to(DTYPE)
    elif quant == "mx":
        rows = mx_dequant(rows, dynamic_scale[:n].flatten(1)).to(DTYPE)
    out = torch.zeros((hidden_states.shape[0], hidden_states.shape[1]), dtype=DTYPE)
    out[:n] = expert_ffn(rows, torch.repeat_interleave(torch.arange(counts.numel()) + first_expert, counts), DTYPE)
    return out


def _mc2_comm_alg(enable_mc2_hierarchy_comm: bool = False) -> str:
    """vllm-ascend's rule (``utils.py`` L1011-1014): hierarchy if RoCE is off and PCIe on inside the node, or forced."""
    env = os.getenv("HCCL_INTRA_ROCE_ENABLE") == "0" and os.getenv("HCCL_INTRA_PCIE_ENABLE") == "1"
    return "hierarchy" if env or enable_mc2_hierarchy_comm else ""


def _vllm_mc2(torch_npu, group, case: dict, rank: int) -> dict:
    """``TokenDispatcherWithMC2`` (A3 / A5): get_dispatch_mc2_kwargs -> dispatch_v2 -> GMM -> get_combine_mc_kwargs."""
    inp = case["inputs"][rank]
    local_rank = torch.distributed.get_rank(group=group)
    moe_all_to_all_group_name = group._get_backend(torch.device("npu")).get_hccl_comm_name(local_rank)
    a5, global_bs, quant_mode = case["a5"], case["global_bs"], case["quant_mode"]
    if case.get("hierarchy_env"):
        os.environ.update(HCCL_INTRA_ROCE_ENABLE="0", HCCL_INTRA_PCIE_ENABLE="1")
    mc2_comm_alg = _mc2_comm_alg()
    need_expert_scale = (a5 or mc2_comm_alg == "hierarchy") and not case.get("drop_expert_scales")
    kwargs_mc2 = {
        "x": inp["x"],
        "expert_ids": inp["topk_ids"],
        "expert_shard_type": 0,
        "shared_expert_rank_num": 0,
        "moe_expert_num": case["e"],
        "global_bs": global_bs,
        "expert_token_nums_type": case["ent"],
    }
    if global_bs == 0:
        kwargs_mc2["x_active_mask"] = inp["mc2_mask"]
    stage1_kwargs = {
        "scales": None,
        "quant_mode": quant_mode,
        "group_ep": moe_all_to_all_group_name,
        "ep_world_size": dist.get_world_size(group),
        "ep_rank_id": local_rank,
    }
    if mc2_comm_alg:
        stage1_kwargs["comm_alg"] = mc2_comm_alg
    stage1_kwargs.update({"group_tp": moe_all_to_all_group_name, "tp_world_size": 1, "tp_rank_id": 0})
    if a5:
        stage1_kwargs.update({"tp_world_size": 1, "tp_rank_id": 0, "y_dtype": torch.float8_e4m3fn})
    if need_expert_scale:
        stage1_kwargs["expert_scales"] = inp["topk_weights"].to(torch.float32)
    kwargs_mc2.update(stage1_kwargs)
    if case.get("strict"):
        kwargs_mc2["strict"] = case["strict"]
    if case.get("expect_error"):
        return {"error": op_error(functools.partial(torch_npu.npu_moe_distribute_dispatch_v2, **kwargs_mc2))}
    output = torch_npu.npu_moe_distribute_dispatch_v2(**kwargs_mc2)
    (
        expand_x,
        dynamic_scale,
        assist_info_for_combine,
        expert_token_nums,
        ep_recv_counts,
        tp_recv_counts,
        expand_scales,
    ) = output[0:7]
    quant = {0: "", 2: "int8", 4: "mx"}[quant_mode]
    hidden_states = _grouped_experts(expand_x, dynamic_scale, expert_token_nums, case["ent"], rank * LOCAL, quant)
    kwargs_mc2 = {
        "expand_x": hidden_states,
        "expert_ids": inp["topk_ids"],
        "expert_scales": inp["topk_weights"].to(torch.float32),
        "expert_shard_type": 0,
        "shared_expert_rank_num": 0,
        "moe_expert_num": case["e"],
        "global_bs": global_bs,
    }
    if global_bs == 0:
        kwargs_mc2["x_active_mask"] = inp["mc2_mask"]
    if quant_mode:  # dispatch_with_quant
        tp_recv_counts = torch.empty(1, dtype=torch.int32)
    stage3_kwargs = {
        "ep_send_counts": ep_recv_counts,
        "group_ep": moe_all_to_all_group_name,
        "ep_world_size": dist.get_world_size(group),
        "ep_rank_id": local_rank,
        "expand_scales": expand_scales,
        "comm_quant_mode": 4 if a5 else 0,
        "assist_info_for_combine": assist_info_for_combine,
    }
    if mc2_comm_alg:
        stage3_kwargs["comm_alg"] = mc2_comm_alg
    stage3_kwargs.update(
        {"tp_send_counts": tp_recv_counts, "group_tp": moe_all_to_all_group_name, "tp_world_size": 1, "tp_rank_id": 0}
    )
    kwargs_mc2.update(stage3_kwargs)
    combined = torch_npu.npu_moe_distribute_combine_v2(**kwargs_mc2)
    return dict(
        expand_x=expand_x,
        dynamic_scale=dynamic_scale,
        assist=assist_info_for_combine,
        expert_token_nums=expert_token_nums,
        ep_recv_counts=ep_recv_counts,
        combined=combined,
    )


def _sgl_ops(torch_npu, group, case: dict, rank: int) -> dict:
    """sgl-kernel-npu's ``OpsLowLatencyCommStrategy`` (padded inputs) and the A5 small-op baseline: the keywords both
    ops take, then each strategy's own (the same keyword set, value for value, as the callers write them)."""
    inp = case["inputs"][rank]
    group_name = group._get_backend(torch.device("npu")).get_hccl_comm_name(group.rank())
    both = dict(
        expert_ids=inp["topk_ids"],
        x_active_mask=inp["mask"],
        group_ep=group_name,
        ep_world_size=dist.get_world_size(group),
        ep_rank_id=rank,
        moe_expert_num=case["e"],
        expert_shard_type=0,
    )
    if case["a5"]:  # test_fused_deep_moe_a5.py
        both.update(group_tp="", tp_world_size=1, tp_rank_id=0, shared_expert_num=1, shared_expert_rank_num=0)
        both.update(global_bs=case["global_bs"])
        own = dict(quant_mode=4, expert_token_nums_type=1, y_dtype=case["y_dtype"])
    else:
        shared_expert_rank_num = int(os.getenv("MOE_SHARED_EXPERT_RANK_NUM", 0))
        both.update(performance_info=None, shared_expert_num=0, shared_expert_rank_num=shared_expert_rank_num)
        both.update(comm_alg=case["comm_alg"])
        expert_token_nums_type = int(os.getenv("MOE_EXPERT_TOKEN_NUMS_TYPE", 1))
        own = dict(quant_mode=case["quant_mode"], expert_token_nums_type=expert_token_nums_type)
    dispatch = functools.partial(
        torch_npu.npu_moe_distribute_dispatch_v2,
        x=inp["x"],
        expert_scales=inp["topk_weights"],
        scales=None,
        **both,
        **own,
    )
    if case.get("expect_error"):
        return {"error": op_error(dispatch)}
    expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = dispatch()
    quant = "mx" if case["a5"] else {0: "", 2: "int8"}[case["quant_mode"]]
    if case["a5"]:  # test_fused_deep_moe_a5.py: the GMM takes the scales as (..., -1, 2) e8m0
        dynamic_scales = dynamic_scales.view(*(dynamic_scales.shape[:-1]), -1, 2).view(torch.float8_e8m0fnu)
    x = _grouped_experts(expand_x, dynamic_scales, expert_token_nums, 1, rank * LOCAL, quant)
    own = dict(tp_send_counts=tp_recv_counts) if case["a5"] else dict(tp_send_counts=None, shared_expert_x=None)
    if not case["a5"]:
        own.update(comm_quant_mode=0)
    out = torch_npu.npu_moe_distribute_combine_v2(
        expand_x=x,
        assist_info_for_combine=expand_idx,
        ep_send_counts=ep_recv_counts,
        expert_scales=inp["topk_weights"],
        expand_scales=expand_scales,
        **both,
        **own,
    )
    n = int(inp["mask"].sum())
    return dict(
        expand_x=expand_x,
        dynamic_scale=dynamic_scales,
        assist=expand_idx,
        expert_token_nums=expert_token_nums,
        ep_recv_counts=ep_recv_counts,
        combined=out[:n],
    )


def _run_callers(info, cases: list[dict]) -> list[dict]:
    torch_npu = sim.install()
    group = dist.new_group(list(range(info.world_size)))  # vllm-ascend's mc2 group / sgl's deep_ep group
    results = []
    for case in cases:
        caller = _vllm_mc2 if case["caller"] == "vllm" else _sgl_ops
        results.append(caller(torch_npu, group, case, info.rank))
    sim.uninstall()
    return results


# --- inputs (parent side) ------------------------------------------------------------------------------------------


def _route(g: torch.Generator, num_tokens: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router: top-k ids (int32) and renormalized weights of random logits."""
    probs = torch.softmax(torch.randn((num_tokens, num_experts), generator=g), dim=-1)
    weights, ids = torch.topk(probs, TOPK, dim=-1)
    return ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).to(DTYPE)


def _vllm_inputs(g: torch.Generator, w: int, actual: list[int], padded: bool, hidden: int = HIDDEN) -> list[dict]:
    """Per rank: ``actual[r]`` real tokens; ``padded``: zero-padded to the largest batch (their router logits are all
    zero, so their top-k comes from an all-zero softmax) with mc2_mask True on the real prefix."""
    e, out = LOCAL * w, []
    bs = max(actual) if padded else None
    for n in actual:
        x = torch.randn((n, hidden), generator=g).to(DTYPE)
        ids, weights = _route(g, n, e)
        if padded:
            zero_w, zero_ids = torch.topk(torch.softmax(torch.zeros((bs - n, e)), dim=-1), TOPK, dim=-1)
            x = torch.cat([x, torch.zeros((bs - n, hidden), dtype=DTYPE)])
            ids = torch.cat([ids, zero_ids.to(torch.int32)])
            weights = torch.cat([weights, (zero_w / zero_w.sum(-1, keepdim=True)).to(DTYPE)])
        mask = torch.arange(x.shape[0]) < n
        out.append(dict(x=x, topk_ids=ids, topk_weights=weights, mc2_mask=mask, mask=mask))
    return out


GARBAGE_IDS = [[1 << 30, -5, -5], [7, 7, 7], [-(1 << 31), 0, 0], [2**31 - 1, -1, 3]]


def _sgl_inputs(g: torch.Generator, w: int, actual: list[int], num_max: int, garbage: bool) -> list[dict]:
    """Per rank: ``actual[r]`` real tokens padded to ``num_max`` (``garbage``: as ``torch.empty`` may leave them, else
    zeros) and a 1D prefix mask; weights fp32."""
    e, out = LOCAL * w, []
    for n in actual:
        x = torch.empty((num_max, HIDDEN), dtype=DTYPE)
        ids = torch.empty((num_max, TOPK), dtype=torch.int32)
        weights = torch.empty((num_max, TOPK), dtype=torch.float32)
        if garbage:
            x[n:] = torch.tensor([float("nan"), float("inf"), -3e38, 1e30] * (HIDDEN // 4), dtype=DTYPE)
            ids[n:] = torch.tensor(GARBAGE_IDS * num_max, dtype=torch.int32)[: num_max - n]
            weights[n:] = torch.tensor([float("nan"), 1e30, -float("inf")])
        else:  # make_small_op_padded_inputs: zeros
            for t in (x, ids, weights):
                t.zero_()
        x[:n] = torch.randn((n, HIDDEN), generator=g).to(DTYPE)
        real_ids, real_w = _route(g, n, e)
        ids[:n], weights[:n] = real_ids, real_w.float()
        out.append(dict(x=x, topk_ids=ids, topk_weights=weights, mask=torch.arange(num_max) < n))
    return out


# --- goldens (parent side) -----------------------------------------------------------------------------------------


def _active(inp: dict) -> int:
    return int(inp["mc2_mask"].sum()) if "mc2_mask" in inp else int(inp["mask"].sum())


def _quantized(row: torch.Tensor, quant: str, y_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatched row and its scales (int8: `[1]` fp32; mx: e8m0 codes) as the documented formulas give them."""
    if quant == "int8":
        q, s = quant_per_token(row, None, torch.int8)
        return q, torch.tensor([s], dtype=torch.float32)
    if quant == "mx":
        return quant_mx(row, y_dtype)
    return row, torch.zeros(0)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, quant: str) -> torch.Tensor:
    if quant == "int8":
        return (q.float() * scale).to(DTYPE)
    if quant == "mx":
        return mx_dequant(q.unsqueeze(0), scale.unsqueeze(0))[0].to(DTYPE)
    return q


def _golden(case: dict, w: int) -> tuple[list[list[tuple]], list[torch.Tensor], list[torch.Tensor]]:
    """Per destination rank its rows ``(src, t, k, e, q, scale)`` (active pairs of the concatenated ranks, stable-sorted
    by expert, as ``npu_moe_init_routing``), per source rank the combined x `[n_active, H]` and, for comm quant, the
    bound of each element."""
    quant, y_dtype = case["quant"], case.get("y_dtype")
    pairs = []
    for r, inp in enumerate(case["inputs"]):
        n = _active(inp)
        pairs += [(r, t, k, int(inp["topk_ids"][t, k])) for t in range(n) for k in range(TOPK)]
    pairs.sort(key=lambda p: p[3])
    rows: list[list[tuple]] = [[] for _ in range(w)]
    for r, t, k, e in pairs:
        q, s = _quantized(case["inputs"][r]["x"][t], quant, y_dtype)
        rows[e // LOCAL].append((r, t, k, e, q, s))
    combined, bounds = [], []
    for inp in case["inputs"]:
        n, out, bound = _active(inp), [], []
        for t in range(n):
            parts, b = [], torch.zeros(HIDDEN)
            for k in range(TOPK):
                e = int(inp["topk_ids"][t, k])
                y = expert_ffn(_dequantized(*_quantized(inp["x"][t], quant, y_dtype), quant).unsqueeze(0), e, DTYPE)[0]
                weight = float(inp["topk_weights"][t, k].float())
                parts.append((weight, y))
                b += abs(weight) * _mx_e4m3_error(y)
            out.append(weighted_sum(parts, HIDDEN))
            bound.append(b)
        combined.append(torch.stack(out) if n else torch.zeros((0, HIDDEN)))
        bounds.append(torch.stack(bound) if n else torch.zeros((0, HIDDEN)))
    return rows, combined, bounds


def _mx_e4m3_error(y: torch.Tensor) -> torch.Tensor:
    """Per element of ``y`` `[H]`, the most comm_quant_mode 4 may change it: MX e4m3 per 32 elements (block scale
    ``s = 2^(floor(log2 amax) - 8)``): half an e4m3 step of ``|y| / s`` (3 mantissa bits, subnormal below 2^-6) or the
    saturation at 448, times s; then the bf16 rounding of the received value."""
    yf, out = y.float(), torch.zeros(HIDDEN)
    for lo in range(0, HIDDEN, 32):
        g = yf[lo : lo + 32].abs()
        amax = float(g.max())
        if amax == 0:
            continue
        s = 2.0 ** max(torch.frexp(torch.tensor(amax)).exponent.item() - 1 - 8, -127)
        v = g / s
        half_step = torch.pow(2.0, torch.clamp(torch.floor(torch.log2(v.clamp(min=2.0**-30))), min=-6) - 4)
        err = torch.where(v > 448, v - 448, half_step) * s
        out[lo : lo + 32] = err + (g + err) * 2.0**-8
    return out


def _check_rows(got: dict, want: list[tuple], rank: int, case: dict, exact_layout: bool) -> None:
    """expand_x / dynamic_scale / assist (exact layout) or per-expert row multisets (opaque layout), and counts."""
    n, quant = len(want), case["quant"]
    counts = torch.bincount(
        torch.tensor([e - rank * LOCAL for *_, e, _q, _s in want], dtype=torch.int64), minlength=LOCAL
    )
    ent = case.get("ent", 1)
    assert torch.equal(got["expert_token_nums"], counts.cumsum(0) if ent == 0 else counts), (case["name"], rank)
    q_rows = torch.stack([q for *_, q, _s in want]) if n else got["expand_x"][:0]
    assert q_rows.dtype == got["expand_x"].dtype, (case["name"], q_rows.dtype, got["expand_x"].dtype)
    scales = got["dynamic_scale"].flatten(1)[:n] if got["dynamic_scale"].dim() > 1 else got["dynamic_scale"][:n, None]
    if exact_layout:
        assert torch.equal(got["expand_x"][:n].view(torch.uint8), q_rows.view(torch.uint8)), (case["name"], rank)
        assert not got["expand_x"][n:].view(torch.uint8).any(), (case["name"], rank)
        triples = [[r, t, k] for r, t, k, *_ in want]
        assert got["assist"][: 3 * n].view(-1, 3).tolist() == triples, (case["name"], rank)
        assert torch.equal(got["ep_recv_counts"][-1:], torch.tensor([n], dtype=torch.int32)), (case["name"], rank)
        if quant:
            want_scales = torch.stack([s for *_, s in want]).view(torch.uint8)
            assert torch.equal(scales.contiguous().view(torch.uint8), want_scales), (case["name"], rank)
        return
    start = 0
    for j in range(LOCAL):  # opaque layout: rows of expert j (with their scales) as a multiset
        m = int(counts[j])
        got_rows = collections.Counter(
            bytes(got["expand_x"][i].view(torch.uint8).tolist())
            + (bytes(scales[i].contiguous().view(torch.uint8)) if quant else b"")
            for i in range(start, start + m)
        )
        mine = [(q, s) for *_, e, q, s in want if e == rank * LOCAL + j]
        want_rows = collections.Counter(
            bytes(q.view(torch.uint8).tolist()) + bytes(s.view(torch.uint8)) for q, s in mine
        )
        assert got_rows == want_rows, (case["name"], rank, j)
        start += m


def _check(case: dict, results: list[dict], w: int, exact_layout: bool) -> None:
    rows, combined, bounds = _golden(case, w)
    for rank, got in enumerate(results):
        _check_rows(got, rows[rank], rank, case, exact_layout)
        n = _active(case["inputs"][rank])
        out = got["combined"][:n]
        if case.get("comm_quant"):  # MX e4m3 on the wire: within the bound, and actually quantized
            err = (out.float() - combined[rank]).abs()
            allowed = bounds[rank] + combined[rank].abs() * 2.0**-8 + 1e-6
            assert bool((err <= allowed).all()), (case["name"], rank, float((err - allowed).max()))
            quantized = not torch.equal(out, combined[rank].to(DTYPE))
            assert quantized or not n, (case["name"], rank, "comm_quant_mode 4 was a no-op")
        else:
            assert torch.equal(out, combined[rank].to(DTYPE)), (case["name"], rank)
        if "mc2_mask" in case["inputs"][rank] and case["global_bs"] == 0:  # padded tokens: zero
            assert not got["combined"][n:].any(), (case["name"], rank)


def _vllm_cases(w: int) -> list[dict]:
    g, e = torch.Generator().manual_seed(100 + w), LOCAL * w
    actual = [3, 5, 0, 2][:w]
    uneven = [4, 1, 6, 2][:w]
    capacity, tp = 6, 1
    # name, quant_mode, expert_token_nums_type, padded (mc2_mask, global_bs 0; else uneven batches, no mask), the rest
    table = [
        ("a3 mask", 0, 0, True, {}),
        ("a3 mask int8", 2, 1, True, {}),
        ("a3 uneven int8", 2, 0, False, {}),
        ("hierarchy", 0, 0, True, dict(hierarchy_env=True, layout="opaque")),
        ("hierarchy no scales", 0, 0, True, dict(hierarchy_env=True, drop_expert_scales=True, expect_error=True)),
        ("a5 mxfp8", 4, 0, True, dict(a5=True, y_dtype=torch.float8_e4m3fn, comm_quant=True)),
        ("a5 on a3", 4, 0, True, dict(a5=True, strict="a3", expect_error=True)),
    ]
    cases = []
    for name, quant_mode, ent, padded, rest in table:
        hidden = 1024 if rest.get("strict") else HIDDEN
        cases.append(
            dict(
                dict(caller="vllm", e=e, a5=False, name=name, quant_mode=quant_mode, ent=ent),
                inputs=_vllm_inputs(g, w, actual if padded else uneven, padded, hidden=hidden),
                global_bs=0 if padded else capacity // tp * w,
                quant={0: "", 2: "int8", 4: "mx"}[quant_mode],
                **rest,
            )
        )
    return cases


def _sgl_cases(w: int) -> list[dict]:
    g, e, num_max = torch.Generator().manual_seed(200 + w), LOCAL * w, 6
    actual = [4, 2, 6, 0][:w]

    def case(name: str, garbage: bool, **rest) -> dict:
        inputs = _sgl_inputs(g, w, actual, num_max, garbage)
        return dict(dict(caller="sgl", e=e, a5=False, name=name, inputs=inputs), **rest)

    cases = [
        case(
            f"ops {alg or 'default-empty'} q{qm}",
            True,
            comm_alg=alg,
            quant_mode=qm,
            quant={0: "", 2: "int8"}[qm],
            layout="exact" if alg == "" else "opaque",
        )
        for alg, qm in (("hierarchy", 0), ("ccu", 2), ("fullmesh_v2", 0), ("", 2))
    ]
    cases.append(case("ops ue8m0", True, comm_alg="hierarchy", quant_mode=3, expect_error=True))
    for y_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, "float4_e2m1fn_x2"):
        mx = dict(a5=True, y_dtype=y_dtype, quant="mx", global_bs=num_max * w, layout="exact")
        cases.append(case(f"a5 {y_dtype}", False, **mx, expect_error=isinstance(y_dtype, str)))
    return cases


def _resolve_names(cases: list[dict]) -> None:
    """``y_dtype`` given by torch_npu constant name -> the stand-in's int code (what ``torch_npu.<name>`` is)."""
    from deep_ep_npu.core.platforms import TORCH_NPU_CONSTANTS

    for case in cases:
        if isinstance(case.get("y_dtype"), str):
            case["y_dtype"] = TORCH_NPU_CONSTANTS[case["y_dtype"]]


def _replayed(world_size: int, cases: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each case with what every rank got replaying it (one launch of ``world_size`` ranks for all the cases)."""
    results = parallel_launch(world_size, _run_callers, cases)
    return [(case, [r[c] for r in results]) for c, case in enumerate(cases)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_vllm_ascend_mc2(world_size):
    cases = _vllm_cases(world_size)
    for case, per_rank in _replayed(world_size, cases):
        if case.get("expect_error"):
            for got in per_rank:
                code, param, text = got["error"]
                if case.get("strict"):  # a5 features on Atlas A3: refused naming both platforms
                    assert (code, param) == (161002, "quant_mode"), got
                    assert "Ascend 950 (A5)" in text and "Atlas A3" in text, text
                else:
                    assert (code, param) == (161001, "expert_scales") and "hierarchy" in text, got
            continue
        _check(case, per_rank, world_size, exact_layout=case.get("layout") != "opaque")


@pytest.mark.parametrize("world_size", [2, 4])
def test_sgl_kernel_npu_ops_strategy(world_size):
    cases = _sgl_cases(world_size)
    _resolve_names(cases)
    for case, per_rank in _replayed(world_size, cases):
        if case.get("expect_error"):
            for got in per_rank:
                code, param, text = got["error"]
                assert (code, param) == (161002, "y_dtype"), got
                assert ("fp4" in text) if case["a5"] else ("quant_mode 3" in text and "float8" in text), text
            continue
        case.setdefault("ent", 1)
        _check(case, per_rank, world_size, exact_layout=case["layout"] == "exact")
