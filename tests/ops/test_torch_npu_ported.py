"""torch_npu's own tests of the MoE distribute ops (Ascend/op-plugin ``test/test_custom_ops/``), ported to CPU gloo
ranks on the NPU stand-in: each rank calls ``torch_npu = sim.install()`` and then the ``torch_npu.npu_moe_distribute_*``
ops with the originals' keywords, naming its groups with the originals' line
``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``. Each test keeps the original's shape: a golden
built in the parent (written here, as the original computes it), a per-rank process function, the comparisons.

What each test ports, and what changed:

- ``test_npu_moe_distribute_dispatch_v2`` / ``test_npu_moe_distribute_combine_v2`` <- ``test_moe_distribute_dispatch_v2
  .py`` and ``test_moe_distribute_combine_v2.py`` (16 NPUs: EP 8 x TP 2, EP groups of same-parity ranks, TP pairs (2i,
  2i+1), ``ep_rank_id = rank // 2``, one expert per rank, x fp16 U[-1, 1], topk ``arange(K)`` tiled, H 7168, Bs 8).
  Here: world 4 = EP 2 x TP 2 (H 128), the original's four dispatch cases (TP 2 / TP 1, with and without a shared-expert
  rank; K = E as E is 1 or 2 now). Golden as the original: concatenate the EP group's x, ``npu_moe_init_routing``
  (stable sort of the flat ids), the shared rank first gets every rank's x, slice per rank by the bincount; TP 2 -> own
  rows then the peer's. Exact on ``expand_x[:n]``; added: exact ``expert_token_nums``, ``ep_recv_counts``,
  ``tp_recv_counts`` and the output shapes. The original's ``torch_npu._npu_distribute_barrier`` (not an op of ours)
  is dropped. Combine: the original feeds a hand-built expand_x, a v1-style ``assist_info_for_combine`` (a per-source
  occurrence index), ``ep_send_counts`` of only W entries and ``tp_send_counts``; our v2 layout takes dispatch's
  (src rank, token, slot) triples and, with TP 2, 2 * W counts, so combine is fed the dispatch outputs of the same
  inputs unchanged (rows past the received total overwritten with random values, as the original's pad), which we
  checked above to equal the original's expand_x; its golden is the original's ``sum_k w * 2x + 2x`` (x2: the TP
  reduce-scatter of two identity experts; the shared expert unweighted), fp32 then one cast to fp16, exact.
- ``test_npu_moe_distribute_dispatch_combine_v2_ep`` <- the same two tests' TP-1 cases, as a plain EP world of 2 and 4
  ranks (no TP groups), with one or two shared-expert ranks, two experts per rank and random distinct top-k ids added;
  combine runs an elementwise expert per global expert id (so a misplaced row shows) against
  ``sum_k w * f_e(x) + f_shared(x)``.
- ``test_npu_moe_distribute_dispatch_combine_a2`` <- ``test_moe_distribute_dispatchA2.py`` / ``combineA2.py``
  (910B, W 16, L 1, v2 with ``comm_alg="fullmesh"``, bf16 x U[-5, 5], K 8 of 16). Here W 2 and 4, K 2 / 3. Dispatch
  golden as the original: ``repeat_interleave(x, K)``, stable sort by expert, slice per rank by the cumulative
  ``expert_token_nums``, per-rank cumsum of the (expert, source) counts; added ``performance_info`` (non-zero exactly
  for the ranks that sent data). The original checks ``assist_info_for_combine[:Bs * K]`` = the A2 occurrence index;
  every ``comm_alg`` gives the A3 fullmesh layout here (ops docs), so instead the (src, token, slot) triple is checked
  at the row the original's occurrence index addresses. Combine input: the original's construction (row
  ``send_counts[j * W + src - 1] + expand_idx`` holds x) is checked to equal dispatch's expand_x (zeros past n
  included); combine is then fed dispatch's outputs (see above); golden ``sum_k w * x`` compared exactly after one
  cast (the original: rtol 2^-8).
- ``test_npu_moe_distribute_dispatch_combine_urma`` <- ``test_moe_distribute_dispatch_combine_urma.py`` (the
  two-stage flow setup -> teardown -> combine_setup -> combine_teardown, 16 NPUs, E 16, Bs 8, H 1024, K 8, quant 2 with
  scales, no golden). Its bugs fixed: the EP group it names is defined (``comm_group`` was a NameError), ``comm_type=2``
  (the 950 tiling takes only URMA; the default 0 is refused, asserted), ``y_dtype=torch.int8`` for quant_mode 2
  (without it torch_npu gives y x's dtype: asserted refused), the int8 expand_x is dequantized with dynamic_scales
  before the experts (it was cast to bf16), combine_setup gets ``comm_quant_mode=0`` (it passed the dispatch's 2: the
  two-stage combine does not quantize; asserted refused). Smooth ``scales`` are the original's `[1 + E, H]` for
  ``shared_expert_num=1, shared_expert_rank_num=0`` (row ``1 + e`` serves expert e; row 0, a shared expert's, is
  unused). Here W 2 and 4, E 2W, Bs 4, H 1024, K 3, ``strict="a5"``; bf16, int8 without and with ``scales``. Checked
  exactly against goldens written here: y (pairs stable-sorted by expert, scale at byte Align32(H)), expand_idx,
  expand_x, dynamic_scales, assist[:W * L] (prefix sums) and the rest zero, expert_token_nums, the combined x; and
  against the one-shot ``_v2`` ops on the same inputs.
"""

from __future__ import annotations

import functools
import importlib.util
import random

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import sim
from tests.support.distributed import op_error, parallel_launch
from tests.support.npu_golden import expert_ffn, init_routing, occurrence_index, quant_per_token, weighted_sum

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu exists")


def _uniform(shape: tuple[int, ...], lo: float, hi: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``create_common_tensor``'s U[lo, hi] data in ``dtype``."""
    return (torch.rand(shape, generator=g) * (hi - lo) + lo).to(dtype)


def _hcomm_name(group: dist.ProcessGroup, rank: int) -> str:
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def _ep(group: str, world_size: int, rank: int, num_experts: int, **more) -> dict:
    """The EP keywords every call of the originals passes (``group_ep`` ... ``moe_expert_num``), and ``more``."""
    return dict(group_ep=group, ep_world_size=world_size, ep_rank_id=rank, moe_expert_num=num_experts, **more)


def _ep_golden(x_list: list[torch.Tensor], topk_list: list[torch.Tensor], sr: int, moe_expert_num: int) -> list[dict]:
    """One EP group's expected receive side, as the originals build it: per EP rank its rows `[n, H]` (shared ranks
    first: the x of sources ``r % SR == i``; MoE ranks: the slice of the init-routing sort), their global experts
    (shared: -1), and its counts `[L, W]` (rows per local expert and source rank)."""
    w, bs = len(x_list), x_list[0].shape[0]
    expand_x, expand_expert, _ = init_routing(torch.cat(x_list), torch.cat(topk_list))
    local = moe_expert_num // (w - sr)
    per_expert = torch.bincount(expand_expert, minlength=moe_expert_num)
    out = []
    for i in range(sr):
        rows = torch.cat([x_list[r] for r in range(w) if r % sr == i])
        counts = torch.tensor([[bs if r % sr == i else 0 for r in range(w)]])
        out.append(dict(rows=rows, experts=torch.full((rows.shape[0],), -1), counts=counts))
    start = 0
    for d in range(w - sr):
        n = int(per_expert[d * local : (d + 1) * local].sum())
        counts = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=moe_expert_num) for t in topk_list], 1)
        out.append(
            dict(
                rows=expand_x[start : start + n],
                experts=expand_expert[start : start + n],
                counts=counts[d * local : (d + 1) * local],
            )
        )
        start += n
    return out


def _recv_counts(own: torch.Tensor, peer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert_token_nums, ep_recv_counts)`` of counts `[L, W]` (+ the TP peer's): per-expert totals (peer added)
    and the inclusive cumsum j-major, the peer's entries continuing it."""
    flat = own.reshape(-1) if peer is None else torch.cat([own.reshape(-1), peer.reshape(-1)])
    tokens = own.sum(1) if peer is None else own.sum(1) + peer.sum(1)
    return tokens.to(torch.int64), flat.cumsum(0).to(torch.int32)


def _dispatch_experts_combine(torch_npu, x, topk, scales, layout: dict, experts, tp_send_counts: bool) -> dict:
    """The originals' round: ``npu_moe_distribute_dispatch_v2`` (no quant) with ``layout``'s keywords, ``experts(got)``
    on what it returned (``got``: ``out`` = expand_x, ``assist``, ``expert_token_nums``, ``ep_recv_counts``,
    ``tp_recv_counts``), then ``npu_moe_distribute_combine_v2`` of that with the same keywords (and ``tp_send_counts``
    if asked); returns ``got`` with ``combined``."""
    names = (
        "out",
        "dynamic_scales",
        "assist",
        "expert_token_nums",
        "ep_recv_counts",
        "tp_recv_counts",
        "expand_scales",
    )
    out = torch_npu.npu_moe_distribute_dispatch_v2(x=x, expert_ids=topk, scales=None, quant_mode=0, **layout)
    got = dict(zip(names, out, strict=True))
    combined = torch_npu.npu_moe_distribute_combine_v2(
        expand_x=experts(got),
        expert_ids=topk,
        assist_info_for_combine=got["assist"],
        ep_send_counts=got["ep_recv_counts"],
        expert_scales=scales,
        **layout,
        **(dict(tp_send_counts=got["tp_recv_counts"]) if tp_send_counts else {}),
    )
    keep = ("out", "expert_token_nums", "ep_recv_counts", "tp_recv_counts")
    return {**{k: got[k] for k in keep}, "combined": combined}


# --- test_moe_distribute_dispatch_v2.py / test_moe_distribute_combine_v2.py: EP 2 x TP 2 ---------------------------


def _init_groups(world_size: int, ep_world_size: int, tp_world_size: int, rank: int):
    """The original's ``_init_dist_hccl``: EP groups of ranks ``i, i + tp, ...``, TP groups of consecutive ranks."""
    ep_ranks_list = [list(range(i, world_size, tp_world_size)) for i in range(tp_world_size)]
    tp_ranks_list = [list(range(i * tp_world_size, (i + 1) * tp_world_size)) for i in range(ep_world_size)]
    ep_groups = [dist.new_group(ranks) for ranks in ep_ranks_list]
    tp_groups = [dist.new_group(ranks) for ranks in tp_ranks_list]
    ep = next(g for g, ranks in zip(ep_groups, ep_ranks_list, strict=True) if rank in ranks)
    tp = next(g for g, ranks in zip(tp_groups, tp_ranks_list, strict=True) if rank in ranks)
    return ep, tp


def _test_npu_moe_distribute_dispatch_combine_v2(info, cases: list[dict]) -> list[dict]:
    torch_npu = sim.install()
    rank, tp_world_size_2 = info.rank, 2
    ep_world_size = info.world_size // tp_world_size_2
    ep_group, tp_group = _init_groups(info.world_size, ep_world_size, tp_world_size_2, rank)
    ep_hcomm_name, tp_hcomm_name = _hcomm_name(ep_group, rank), _hcomm_name(tp_group, rank)
    results = []
    for case in cases:
        tp_world_size, sr, e, gbs = case["tp"], case["sr"], case["e"], case["global_bs"]
        pair = rank // tp_world_size_2
        x = case["x1"][pair] if rank % tp_world_size_2 == 0 else case["x2"][pair]
        topk = case["topk1"][pair] if rank % tp_world_size_2 == 0 else case["topk2"][pair]
        scales = case["scales1"][pair] if rank % tp_world_size_2 == 0 else case["scales2"][pair]
        tp = dict(group_tp=tp_hcomm_name, tp_world_size=tp_world_size, tp_rank_id=rank % tp_world_size)
        shared = dict(expert_shard_type=0, shared_expert_num=int(sr > 0), shared_expert_rank_num=sr)
        layout = _ep(ep_hcomm_name, ep_world_size, pair, e, **tp, **shared, global_bs=gbs)

        def padded(got: dict) -> torch.Tensor:  # the original pads the rows past n with random values
            n, expand_x = int(got["tp_recv_counts"].sum()), got["out"].clone()
            pad = torch.Generator().manual_seed(rank)
            expand_x[n:] = _uniform((expand_x.shape[0] - n, expand_x.shape[1]), 0, 1, expand_x.dtype, pad)
            return expand_x

        results.append(_dispatch_experts_combine(torch_npu, x, topk, scales, layout, padded, tp_send_counts=True))
    sim.uninstall()
    return results


def _construct_expected_result(case: dict, ep_world_size: int) -> list[dict]:
    """Per global rank (2i: EP group 1 = x1, 2i + 1: EP group 2 = x2) its expected dispatch outputs and combine."""
    tp, sr = case["tp"], case["sr"]
    golden1 = _ep_golden(case["x1"], case["topk1"], sr, case["e"])
    golden2 = _ep_golden(case["x2"], case["topk2"], sr, case["e"])
    out_list = []
    for i in range(ep_world_size):
        for own, peer in ((golden1[i], golden2[i]), (golden2[i], golden1[i])):
            rows = torch.cat((own["rows"], peer["rows"])) if tp == 2 else own["rows"]
            tokens, counts = _recv_counts(own["counts"], peer["counts"] if tp == 2 else None)
            tp_counts = [own["rows"].shape[0], peer["rows"].shape[0]] if tp == 2 else [own["rows"].shape[0]]
            if tp == 2 and len(out_list) % 2:  # [tp_rank] = own rows: TP rank 1 holds the peer's count first
                tp_counts = tp_counts[::-1]
            out_list.append(
                dict(
                    out=rows,
                    expert_token_nums=tokens,
                    ep_recv_counts=counts,
                    tp_recv_counts=torch.tensor(tp_counts, dtype=torch.int32),
                )
            )
    for rank, want in enumerate(out_list):  # combine: sum_k w * (tp * x) + tp * x for the shared expert, fp32
        group, pair = ("1", "2")[rank % 2], rank // 2
        x, scales = case["x" + group][pair], case["scales" + group][pair]
        combined = []
        for t in range(x.shape[0]):
            parts = [(float(scales[t, j]), x[t].float() * tp) for j in range(scales.shape[1])]
            combined.append(weighted_sum(parts + [(1.0, x[t].float() * tp)] * (sr > 0), x.shape[1]))
        want["combined"] = torch.stack(combined).to(x.dtype)
    return out_list


def _dispatch_v2_case(
    g: torch.Generator, tp: int, sr: int, e: int, k: int, ep_world_size: int, bs: int = 8, h: int = 128
) -> dict:
    topk = torch.tile(torch.arange(k), (bs,)).int().view(-1, k)
    case = dict(tp=tp, sr=sr, e=e, global_bs=bs * ep_world_size)
    for group in ("1", "2"):
        case["x" + group] = [_uniform((bs, h), -1, 1, torch.float16, g) for _ in range(ep_world_size)]
        case["topk" + group] = [topk] * ep_world_size
        case["scales" + group] = [_uniform((bs, k), -1, 1, torch.float32, g) for _ in range(ep_world_size)]
    return case


def test_npu_moe_distribute_dispatch_v2():
    """The original's four cases on EP 2 x TP 2 (and its combine_v2 on each; combine_v2's own case is the first)."""
    ep_world_size, tp_world_size = 2, 2
    g = torch.Generator().manual_seed(0)
    cases = [
        _dispatch_v2_case(g, tp=2, sr=1, e=1, k=1, ep_world_size=ep_world_size),
        _dispatch_v2_case(g, tp=2, sr=0, e=2, k=2, ep_world_size=ep_world_size),
        _dispatch_v2_case(g, tp=1, sr=1, e=1, k=1, ep_world_size=ep_world_size),
        _dispatch_v2_case(g, tp=1, sr=0, e=2, k=2, ep_world_size=ep_world_size),
    ]
    results = parallel_launch(ep_world_size * tp_world_size, _test_npu_moe_distribute_dispatch_combine_v2, cases)
    for c, case in enumerate(cases):
        expected = _construct_expected_result(case, ep_world_size)
        for rank in range(ep_world_size * tp_world_size):
            got, want = results[rank][c], expected[rank]
            shared = rank // 2 < case["sr"]
            a = case["global_bs"] // case["sr"] if shared else case["global_bs"] * case["e"] // (2 - case["sr"])
            n = want["out"].shape[0]
            assert got["out"].shape == (case["tp"] * a, 128), (c, rank)
            assert torch.equal(got["out"][:n], want["out"]), f"case {c} rank {rank}: expand_x[:{n}]"
            for name in ("expert_token_nums", "ep_recv_counts", "tp_recv_counts"):
                assert torch.equal(got[name], want[name]), (c, rank, name, got[name], want[name])
            assert torch.equal(got["combined"], want["combined"]), f"case {c} rank {rank}: combine_v2"


# --- the TP-1 cases as a plain EP world (W 2 and 4), shared-expert ranks, L 2, random distinct ids -----------------


def _test_npu_moe_distribute_ep(info, cases: list[dict]) -> list[dict]:
    torch_npu = sim.install()
    rank, w = info.rank, info.world_size
    ep_hcomm_name = _hcomm_name(dist.new_group(list(range(w))), rank)
    results = []
    for case in cases:
        x, topk, scales, sr = case["x"][rank], case["topk"][rank], case["scales"][rank], case["sr"]
        shared = dict(expert_shard_type=0, shared_expert_num=int(sr > 0), shared_expert_rank_num=sr)
        layout = _ep(ep_hcomm_name, w, rank, case["e"], **shared, global_bs=case["global_bs"])
        local = case["e"] // (w - sr)  # local expert j of MoE rank d is global d' * L + j, d' = d - SR; shared: -1

        def ffn(got: dict, local: int = local, sr: int = sr, dtype: torch.dtype = x.dtype) -> torch.Tensor:
            n = int(got["ep_recv_counts"][-1])
            experts = (
                torch.full((n,), -1)
                if rank < sr
                else torch.repeat_interleave(torch.arange(local) + (rank - sr) * local, got["expert_token_nums"])
            )
            y = torch.zeros_like(got["out"])
            y[:n] = expert_ffn(got["out"][:n], experts, dtype)
            return y

        results.append(_dispatch_experts_combine(torch_npu, x, topk, scales, layout, ffn, tp_send_counts=False))
    sim.uninstall()
    return results


def _ep_case(g: torch.Generator, w: int, sr: int, e: int, k: int, tiled: bool, bs: int = 6, h: int = 64) -> dict:
    moe = list(range(e))
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=g)))
    case = dict(sr=sr, e=e, global_bs=bs * w, x=[], topk=[], scales=[])
    for _ in range(w):
        case["x"].append(_uniform((bs, h), -1, 1, torch.float16, g))
        ids = [list(range(k)) if tiled else rng.sample(moe, k) for _ in range(bs)]
        case["topk"].append(torch.tensor(ids, dtype=torch.int32))
        case["scales"].append(_uniform((bs, k), -1, 1, torch.float32, g))
    return case


EP_CASES = {  # world size -> (sr, e, k, tiled)
    2: [(0, 2, 2, True), (1, 1, 1, True), (0, 4, 3, False)],
    4: [(1, 3, 3, True), (2, 2, 2, True), (0, 8, 4, False), (1, 6, 3, False)],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_npu_moe_distribute_dispatch_combine_v2_ep(world_size):
    g = torch.Generator().manual_seed(world_size)
    cases = [_ep_case(g, world_size, *spec) for spec in EP_CASES[world_size]]
    results = parallel_launch(world_size, _test_npu_moe_distribute_ep, cases)
    for c, case in enumerate(cases):
        golden = _ep_golden(case["x"], case["topk"], case["sr"], case["e"])
        for rank in range(world_size):
            got, want = results[rank][c], golden[rank]
            n, sr = want["rows"].shape[0], case["sr"]
            local = case["e"] // (world_size - sr)
            a = case["global_bs"] // sr if rank < sr else case["global_bs"] * min(local, case["topk"][0].shape[1])
            tokens, counts = _recv_counts(want["counts"], None)
            if rank < sr:  # a shared rank counts all its rows as one expert
                tokens = tokens.sum(0, keepdim=True)
            assert got["out"].shape == (a, 64) and not got["out"][n:].any(), (c, rank)
            assert torch.equal(got["out"][:n], want["rows"]), f"case {c} rank {rank}: expand_x[:{n}]"
            assert torch.equal(got["expert_token_nums"], tokens), (c, rank, got["expert_token_nums"], tokens)
            assert torch.equal(got["ep_recv_counts"], counts), (c, rank, got["ep_recv_counts"], counts)
            assert got["tp_recv_counts"].shape == (0,), (c, rank)  # (tp_world_size,) with tp_world_size 0
        for rank in range(world_size):  # combine: sum_k w * f_e(x) over the slots, then the shared expert, one cast
            x, topk, scales = case["x"][rank], case["topk"][rank], case["scales"][rank]
            want = []
            for t in range(x.shape[0]):
                parts = [
                    (float(scales[t, j]), expert_ffn(x[t : t + 1], int(topk[t, j]), x.dtype)[0])
                    for j in range(topk.shape[1])
                ]
                if case["sr"]:
                    parts.append((1.0, expert_ffn(x[t : t + 1], -1, x.dtype)[0]))
                want.append(weighted_sum(parts, x.shape[1]))
            assert torch.equal(results[rank][c]["combined"], torch.stack(want).to(x.dtype)), (c, rank)


# --- test_moe_distribute_dispatchA2.py / test_moe_distribute_combineA2.py: comm_alg "fullmesh", L 1 -----------------


def _gen_dispatch_golden(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    k: int,
    world_size: int,
    bs: int,
    total_expert_num: int,
    expert_num_per_rank: int,
) -> tuple[list, torch.Tensor]:
    """The original's ``gen_dispatch_golden`` (quant_mode 0, no scales) on the concatenated x `[W * Bs, H]`."""
    expand_x = torch.repeat_interleave(x, k, dim=0)
    flat = expert_ids.reshape(-1).long()
    _, sorted_idx = torch.sort(flat, stable=True)
    expand_x_sorted = expand_x[sorted_idx]
    expert_token_nums = torch.bincount(flat, minlength=total_expert_num)
    per_rank = [expert_token_nums[r * expert_num_per_rank : (r + 1) * expert_num_per_rank] for r in range(world_size)]
    expert_tokens_num_cumsum = [t.cumsum(0) for t in per_rank]
    chunks = expert_ids.reshape(world_size, bs * k)
    ep_recv_counts = torch.tensor(
        [int((chunks[r] == e).sum()) for e in range(total_expert_num) for r in range(world_size)], dtype=torch.int32
    )
    span = expert_num_per_rank * world_size
    ep_recv_counts_cumsum = [
        ep_recv_counts[r * span : (r + 1) * span].cumsum(0).to(torch.int32) for r in range(world_size)
    ]
    actual_tokens = torch.stack([t.sum() for t in per_rank]).cumsum(0)
    return [expand_x_sorted, expert_tokens_num_cumsum, ep_recv_counts_cumsum], actual_tokens


def _gen_combine_input(x_world, expert_ids_world, world_size, bs, moe_expert_num, a) -> tuple[list, list]:
    """The original's ``gen_combine_input``: rank dst's row ``send_counts[dst][j * W + src - 1] + expand_idx`` holds
    token x of source src routed to its local expert j. Returns each rank's expand_x `[A, H]` and, per rank, the
    (row, src, token, slot) of every row so placed."""
    local = moe_expert_num // world_size
    counts = torch.stack(
        [
            torch.bincount(expert_ids_world[r * bs : (r + 1) * bs].reshape(-1).long(), minlength=moe_expert_num)
            for r in range(world_size)
        ]
    )
    send_counts = counts.T.reshape(world_size, local * world_size).cumsum(-1)
    expandx = [torch.zeros((a, x_world.shape[1]), dtype=x_world.dtype) for _ in range(world_size)]
    routed: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world_size)]
    for src in range(world_size):
        ids = expert_ids_world[src * bs : (src + 1) * bs]
        idx = occurrence_index(ids).view(ids.shape)
        for i in range(bs):
            for j in range(ids.shape[1]):
                dst, e_in_rank = divmod(int(ids[i, j]), local)
                base = 0 if e_in_rank == 0 and src == 0 else int(send_counts[dst][e_in_rank * world_size + src - 1])
                expandx[dst][base + int(idx[i, j])] = x_world[src * bs + i]
                routed[dst].append((base + int(idx[i, j]), src, i, j))
    return expandx, routed


def _run_dispatch_combine_a2(info, x_input, expert_ids_input, expert_scales, total_expert_num, global_bs, comm_alg):
    torch_npu = sim.install()
    rank, w = info.rank, info.world_size
    ep_hcomm_info = _hcomm_name(dist.new_group(list(range(w))), rank)
    perf = torch.zeros((w,), dtype=torch.int64)
    x, ids = x_input[rank], expert_ids_input[rank]
    ep = _ep(ep_hcomm_info, w, rank, total_expert_num, global_bs=global_bs, comm_alg=comm_alg, performance_info=perf)
    expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = (
        torch_npu.npu_moe_distribute_dispatch_v2(x=x, expert_ids=ids, scales=None, quant_mode=0, **ep)
    )
    perf_dispatch = perf.clone()
    x_out = torch_npu.npu_moe_distribute_combine_v2(
        expand_x=expand_x,
        expert_ids=ids,
        assist_info_for_combine=expand_idx,
        ep_send_counts=ep_recv_counts,
        tp_send_counts=tp_recv_counts,
        expert_scales=expert_scales[rank],
        **ep,
    )
    sim.uninstall()
    return [expand_x, expand_idx, expert_token_nums, ep_recv_counts, perf_dispatch, perf, x_out]


@pytest.mark.parametrize("ep_world_size,k", [(2, 2), (4, 3)])
def test_npu_moe_distribute_dispatch_combine_a2(ep_world_size, k):
    bs, h, expert_num_per_rank, comm_alg = 8, 64, 1, "fullmesh"
    total_expert_num, global_bs = ep_world_size * expert_num_per_rank, bs * ep_world_size
    g, rng = torch.Generator().manual_seed(k), random.Random(k)
    x = _uniform((global_bs, h), -5, 5, torch.bfloat16, g)  # gen_x
    expert_ids = torch.tensor([rng.sample(range(total_expert_num), k) for _ in range(global_bs)], dtype=torch.int32)
    expert_scales = _uniform((global_bs, k), -5, 5, torch.float32, g)
    x_input, ids_input, scales_input = (t.split(bs) for t in (x, expert_ids, expert_scales))
    golden, actual_tokens = _gen_dispatch_golden(
        x, expert_ids, k, ep_world_size, bs, total_expert_num, expert_num_per_rank
    )
    a = expert_num_per_rank * global_bs
    expandx_world, routed = _gen_combine_input(x, expert_ids, ep_world_size, bs, total_expert_num, a)
    results = parallel_launch(
        ep_world_size, _run_dispatch_combine_a2, x_input, ids_input, scales_input, total_expert_num, global_bs, comm_alg
    )
    for rank_id, (expand_x, expand_idx, token_nums, recv_counts, perf_d, perf_c, x_out) in enumerate(results):
        start = int(actual_tokens[rank_id - 1]) if rank_id > 0 else 0
        end = int(actual_tokens[rank_id])
        assert torch.equal(expand_x[: end - start], golden[0][start:end]), f"rank {rank_id}: expand_x"
        assert torch.equal(expand_x, expandx_world[rank_id]), f"rank {rank_id}: the original's combine input"
        for row, src, t, j in routed[rank_id]:  # the row the original's occurrence index addresses holds its triple
            assert expand_idx[3 * row : 3 * row + 3].tolist() == [src, t, j], (rank_id, row, src, t, j)
        assert torch.equal(token_nums, golden[1][rank_id]), (rank_id, token_nums, golden[1][rank_id])
        span = expert_num_per_rank * ep_world_size
        assert torch.equal(recv_counts[:span], golden[2][rank_id]), (rank_id, recv_counts, golden[2][rank_id])
        sent = golden[2][rank_id].diff(prepend=torch.zeros(1, dtype=torch.int32)) > 0  # sources with rows here
        assert bool((perf_d[sent] > 0).all()) and not perf_d[~sent].any(), (rank_id, perf_d, sent)
        assert bool((perf_c >= perf_d).all()) and not perf_c[~sent].any(), (rank_id, perf_c)
        xs, ws = x_input[rank_id], scales_input[rank_id]  # golden: sum_k w * x (fp32), one cast
        want = torch.stack([weighted_sum([(float(ws[t, j]), xs[t]) for j in range(k)], h) for t in range(bs)])
        assert torch.equal(x_out, want.to(torch.bfloat16)), f"rank {rank_id}: combine"


# --- test_moe_distribute_dispatch_combine_urma.py: the two-stage flow ------------------------------------------------


def _experts(rows: torch.Tensor, counts: torch.Tensor, first_expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Run ``expert_ffn`` on ``rows[:sum(counts)]`` grouped per local expert (``counts``: rows per expert)."""
    n = int(counts.sum())
    experts = torch.repeat_interleave(torch.arange(counts.numel()) + first_expert, counts)
    out = torch.zeros((rows.shape[0], rows.shape[1]), dtype=dtype)
    out[:n] = expert_ffn(rows[:n], experts, dtype)
    return out


def _test_npu_moe_distribute_dispatch_combine_urma(info, cases: list[dict]) -> list[dict]:
    torch_npu = sim.install()
    rank, ep_world_size = info.rank, info.world_size
    ep_group = dist.new_group(ranks=list(range(ep_world_size)))  # the original named an undefined `comm_group`
    ep_hcomm_info = ep_group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
    results = []
    for c, case in enumerate(cases):
        quant_mode, moe_expert_num, global_bs = case["quant_mode"], case["e"], case["global_bs"]
        x, expert_ids, expert_scales = case["x"][rank], case["expert_ids"][rank], case["expert_scales"][rank]
        scales, local = case["scales"], moe_expert_num // ep_world_size
        urma = dict(expert_shard_type=0, shared_expert_rank_num=0, global_bs=global_bs, comm_type=2, strict="a5")
        common = _ep(ep_hcomm_info, ep_world_size, rank, moe_expert_num, **urma)
        setup = functools.partial(
            torch_npu.npu_moe_distribute_dispatch_setup, x=x, expert_ids=expert_ids, scales=scales
        )
        errors = {}
        if c == 0:  # the original's bugs, each refused on every rank
            no_urma = {**common, "comm_type": 0}
            errors["comm_type"] = op_error(functools.partial(setup, quant_mode=2, y_dtype=torch.int8, **no_urma))
            errors["y_dtype"] = op_error(functools.partial(setup, quant_mode=2, **common))
        y, expand_idx, comm_cmd_info = setup(
            quant_mode=quant_mode, y_dtype=torch.int8 if quant_mode else None, **common
        )
        expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums = (
            torch_npu.npu_moe_distribute_dispatch_teardown(
                x=x, y=y, expert_ids=expert_ids, comm_cmd_info=comm_cmd_info, quant_mode=quant_mode, **common
            )
        )
        rows = (expand_x.float() * dynamic_scales.unsqueeze(1)).to(x.dtype) if quant_mode else expand_x  # dequantize
        ffn = _experts(rows, expert_token_nums, rank * local, x.dtype)
        combine_in = dict(expand_x=ffn, expert_ids=expert_ids, **common)  # what combine's setup and teardown share
        combine_setup = functools.partial(
            torch_npu.npu_moe_distribute_combine_setup, assist_info_for_combine=assist_info_for_combine, **combine_in
        )
        if c == 0:
            errors["comm_quant_mode"] = op_error(functools.partial(combine_setup, comm_quant_mode=2))
        quant_expand_x, comm_cmd_info2 = combine_setup(comm_quant_mode=0)
        teardown = dict(quant_expand_x=quant_expand_x, expand_idx=expand_idx, comm_cmd_info=comm_cmd_info2)
        out = torch_npu.npu_moe_distribute_combine_teardown(
            expert_scales=expert_scales, comm_quant_mode=0, **teardown, **combine_in
        )
        # the one-shot ops on the same inputs
        one_shot = _ep(ep_hcomm_info, ep_world_size, rank, moe_expert_num, global_bs=global_bs)
        one = torch_npu.npu_moe_distribute_dispatch_v2(
            x=x, expert_ids=expert_ids, scales=scales, quant_mode=quant_mode, expert_token_nums_type=1, **one_shot
        )
        one_rows = (one[0].float() * one[1].unsqueeze(1)).to(x.dtype) if quant_mode else one[0]
        one_out = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=_experts(one_rows, one[3], rank * local, x.dtype),
            expert_ids=expert_ids,
            assist_info_for_combine=one[2],
            ep_send_counts=one[4],
            expert_scales=expert_scales,
            **one_shot,
        )
        results.append(
            dict(
                y=y,
                expand_idx=expand_idx,
                cmd=comm_cmd_info,
                expand_x=expand_x,
                dynamic_scales=dynamic_scales,
                assist=assist_info_for_combine,
                expert_token_nums=expert_token_nums,
                qx=quant_expand_x,
                cmd2=comm_cmd_info2,
                out=out,
                one_expand_x=one[0],
                one_scales=one[1],
                one_out=one_out,
                errors=errors,
            )
        )
    sim.uninstall()
    return results


def _urma_case(
    g: torch.Generator,
    ep_world_size: int,
    quant_mode: int,
    is_dispatch_scales: bool,
    bs: int = 4,
    h: int = 1024,
    k: int = 3,
) -> dict:
    moe_expert_num = 2 * ep_world_size
    case = dict(
        quant_mode=quant_mode, e=moe_expert_num, global_bs=bs * ep_world_size, x=[], expert_ids=[], expert_scales=[]
    )
    for _ in range(ep_world_size):
        case["x"].append(torch.randn((bs, h), generator=g).to(torch.bfloat16))
        case["expert_ids"].append(
            torch.stack([torch.randperm(moe_expert_num, generator=g)[:k] for _ in range(bs)]).to(torch.int32)
        )
        case["expert_scales"].append(torch.randn((bs, k), generator=g))
    case["scales"] = torch.randn((1 + moe_expert_num, h), generator=g) if is_dispatch_scales else None
    return case


def _smooth(case: dict, e: int) -> torch.Tensor | None:
    """The smooth-scale row of routed expert e: ``scales[S + e]`` with S = 1 as passed (no shared-expert ranks)."""
    return None if case["scales"] is None else case["scales"][1 + e]


def _golden_y(x, expert_ids, quant_mode, case, hs):
    """dispatch_setup's y: pairs stable-sorted by expert id, each row its token (quantized with the pair's expert's
    smooth row; the fp32 scale at byte Align32(H)); Bs * (K + 1) rows, the rest zero. And expand_idx."""
    bs, k = expert_ids.shape
    _, experts, order = init_routing(x, expert_ids)
    y = torch.zeros((bs * (k + 1), hs), dtype=torch.int8 if quant_mode else x.dtype)
    h, at = x.shape[1], -(-x.shape[1] // 32) * 32
    for i, (pos, e) in enumerate(zip(order.tolist(), experts.tolist(), strict=True)):
        if quant_mode:
            q, scale = quant_per_token(x[pos // k], _smooth(case, e), torch.int8)
            y[i, :h] = q
            y[i].view(torch.uint8)[at : at + 4] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
        else:
            y[i, :h] = x[pos // k]
    return y, occurrence_index(expert_ids)


@pytest.mark.parametrize("ep_world_size", [2, 4])
def test_npu_moe_distribute_dispatch_combine_urma(ep_world_size):
    g = torch.Generator().manual_seed(10 + ep_world_size)
    cases = [
        _urma_case(g, ep_world_size, 2, True),
        _urma_case(g, ep_world_size, 2, False),
        _urma_case(g, ep_world_size, 0, False),
    ]
    results = parallel_launch(ep_world_size, _test_npu_moe_distribute_dispatch_combine_urma, cases)
    errors = [r[0]["errors"] for r in results]
    for err in errors:
        assert err["comm_type"][:2] == (161002, "comm_type") and "URMA" in err["comm_type"][2], err
        assert err["y_dtype"][:2] == (161001, "y_dtype"), err
        assert err["comm_quant_mode"][:2] == (161002, "comm_quant_mode"), err
    for c, case in enumerate(cases):
        quant_mode, e, gbs, h = case["quant_mode"], case["e"], case["global_bs"], 1024
        local, k, bs = e // ep_world_size, 3, 4
        hs = -(-(h + 4) // 512) * 512 if quant_mode else -(-h // 256) * 256
        golden = _ep_golden(case["x"], case["expert_ids"], 0, e)
        a = gbs * min(local, k)
        for rank in range(ep_world_size):
            got, want = results[rank][c], golden[rank]
            x, ids, ws = case["x"][rank], case["expert_ids"][rank], case["expert_scales"][rank]
            y, expand_idx = _golden_y(x, ids, quant_mode, case, hs)
            assert torch.equal(got["y"], y), f"case {c} rank {rank}: y"
            assert torch.equal(got["expand_idx"], expand_idx), f"case {c} rank {rank}: expand_idx"
            assert got["cmd"].shape == ((bs * (k + 1) + ep_world_size * local) * 16,), (c, rank)
            n = want["rows"].shape[0]
            rows, scales = torch.zeros((a, h), dtype=torch.int8 if quant_mode else x.dtype), torch.zeros(a)
            for i in range(n):
                if quant_mode:
                    e_i = int(want["experts"][i])
                    q, s = quant_per_token(want["rows"][i], _smooth(case, e_i), torch.int8)
                    rows[i], scales[i] = q, s
                else:
                    rows[i] = want["rows"][i]
            assert torch.equal(got["expand_x"], rows), f"case {c} rank {rank}: expand_x"
            assert torch.equal(got["dynamic_scales"], scales), f"case {c} rank {rank}: dynamic_scales"
            tokens, counts = _recv_counts(want["counts"], None)
            assert got["assist"].shape == (a * 128,) and torch.equal(got["assist"][: ep_world_size * local], counts)
            assert not got["assist"][ep_world_size * local :].any()
            assert torch.equal(got["expert_token_nums"], tokens), (c, rank)
            qx_cols = -(-(-(-h // 32) * 32 + -(-h // 8) * 8 // 8 * 4) // 512) * 512
            assert got["qx"].shape == (a, qx_cols) and got["qx"].dtype == torch.int8
            assert got["cmd2"].shape == ((a + ep_world_size) * 16,)
            assert torch.equal(got["one_expand_x"], got["expand_x"]) and torch.equal(got["one_scales"][:n], scales[:n])
            want_out = []  # sum_k w * f_e(dequant(q(x, e))) in fp32, one cast
            for t in range(bs):
                parts = []
                for j in range(k):
                    e_j = int(ids[t, j])
                    row = x[t]
                    if quant_mode:
                        q, s = quant_per_token(row, _smooth(case, e_j), torch.int8)
                        row = (q.float() * torch.tensor(s, dtype=torch.float32)).to(x.dtype)
                    parts.append((float(ws[t, j]), expert_ffn(row.unsqueeze(0), e_j, x.dtype)[0]))
                want_out.append(weighted_sum(parts, h))
            want_out = torch.stack(want_out).to(x.dtype)
            assert torch.equal(got["out"], want_out), f"case {c} rank {rank}: combine_teardown"
            assert torch.equal(got["one_out"], want_out), f"case {c} rank {rank}: combine_v2"
