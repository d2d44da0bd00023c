"""Redundant experts do not change the model: dispatch / combine on physical ids (logical ids mapped through an
ExpertMap by npu_moe_update_expert's semantics) equal the no-redundancy run bit for bit, for random valid placements
(replicas on any rank, two on one rank allowed), at EP 2 and 4, on the window and collective transports, through
DeepEP's Buffer (combine in slot order), DeepEP V2's ElasticBuffer (expand layout, without multiple reduction, which
pre-sums a token's rows per rank), torch_npu's ops on the stand-in and the Buffer's Ascend backend on it. The experts
are functions of (logical id, row) only; every rank builds every rank's inputs from seeds. The per-slot receive
counts (cumulative_local_expert_recv_stats / expert_token_nums) summed per logical expert equal the routed pairs:
the load statistics need no extra communication."""

from __future__ import annotations

import random

import pytest
import torch

from deep_ep_npu import Buffer, ElasticBuffer
from deep_ep_npu.eplb import ExpertMap, default_placement
from tests.support.distributed import parallel_launch

E, K, H, N = 8, 3, 128, 6


def _placement(seed: int, num_ranks: int, redundant: int) -> torch.Tensor:
    """A random valid placement: every expert once, ``redundant`` random extra replicas, shuffled over the slots."""
    rng = random.Random(seed)
    slots = list(range(E)) + [rng.randrange(E) for _ in range(redundant)]
    rng.shuffle(slots)
    return torch.tensor([slots])


def _inputs(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    t = [5, 0, 6, 3][rank]
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(t, E, generator=g).argsort(dim=1)[:, :K]
    if t:
        idx[0, 1] = -1
    return x, idx, torch.rand(t, K, generator=g)


def _expert(logical: int, rows: torch.Tensor) -> torch.Tensor:
    """Logical expert ``logical`` on its rows (bf16 in, bf16 out): a function of the id and the row only."""
    return torch.tanh(rows.float() * (0.5 + 0.25 * logical) + 0.01 * logical).to(rows.dtype)


def _buffer_run(info, buffer: Buffer, emap: ExpertMap, x, idx, weights, ascend: bool):  # noqa: ANN001, ANN202
    phys = emap.to_physical(0, idx, info.rank)
    stats = torch.zeros(emap.num_local, dtype=torch.int32)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, phys, N, emap.num_physical, use_fp8=False, cumulative_local_expert_recv_stats=stats
    )
    out = torch.zeros_like(recv_x, dtype=torch.bfloat16 if ascend else torch.float32)  # fp32: every bit shows
    for j, logical in enumerate(emap.local_experts(0, info.rank)):
        n = int(recv_count[j])
        out[j, :n] = _expert(logical, recv_x[j, :n]).to(out.dtype)
    kwargs = {} if ascend else {"slot_order": True}
    combined, _, _ = buffer.low_latency_combine(out, phys, weights, handle, **kwargs)
    return combined, stats


def _elastic_run(info, buffer, emap: ExpertMap, x, idx, weights):  # noqa: ANN001, ANN202
    """DeepEP V2's expand layout: one row per (token, local slot), pre-weighted rows, summed by slot."""
    phys = emap.to_physical(0, idx, info.rank)
    stats = torch.zeros(emap.num_local, dtype=torch.int32)
    recv_x, _, recv_w, handle, _ = buffer.dispatch(
        x, phys, weights, cumulative_local_expert_recv_stats=stats, num_experts=emap.num_physical, do_expand=True
    )
    out, start = torch.zeros(recv_x.shape, dtype=torch.float32), 0
    for logical, count in zip(emap.local_experts(0, info.rank), stats.tolist(), strict=True):
        rows = slice(start, start + count)
        out[rows] = _expert(logical, recv_x[rows]).float() * recv_w[rows].unsqueeze(1)
        start += count
    combined, _, _ = buffer.combine(out, handle)
    return combined, stats


def _ops_run(info, emap: ExpertMap, x, idx, weights):  # noqa: ANN001, ANN202
    import torch_npu

    from deep_ep_npu import sim

    table = emap.tables[0]
    phys, _ = torch_npu.npu_moe_update_expert(
        idx.clamp(min=0).to(torch.int32),
        table,
        local_rank_id=info.rank,
        world_size=info.world_size,
        balance_mode=emap.balance_mode,
    )
    phys = torch.where(idx >= 0, phys, -1) if x.shape[0] else phys
    common = dict(
        group_ep=sim.hccl_comm_name(info.group),
        ep_world_size=info.world_size,
        ep_rank_id=info.rank,
        moe_expert_num=emap.num_physical,
        global_bs=N * info.world_size,
    )
    x1, ids1, w1 = (
        (x, phys.clamp(min=0).to(torch.int32), weights)
        if x.shape[0]
        else (torch.zeros(1, H, dtype=x.dtype), torch.zeros(1, K, dtype=torch.int32), torch.zeros(1, K))
    )
    active = (idx >= 0) if x.shape[0] else torch.zeros(1, K, dtype=torch.bool)  # -1 pairs: a 2-D active mask
    expand_x, _, assist, token_nums, ep_recv, _, expand_scales = torch_npu.npu_moe_distribute_dispatch_v2(
        x1, ids1, x_active_mask=active, expert_token_nums_type=1, **common
    )
    out, start = torch.zeros_like(expand_x), 0
    for logical, count in zip(emap.local_experts(0, info.rank), token_nums.tolist(), strict=True):
        out[start : start + count] = _expert(logical, expand_x[start : start + count])
        start += count
    y = torch_npu.npu_moe_distribute_combine_v2(
        out, ids1, assist, ep_recv, w1, x_active_mask=active, expand_scales=expand_scales, **common
    )
    return y[: x.shape[0]], token_nums


def _rank(info, path: str, seeds: list[int], redundant: int):  # noqa: ANN001, ANN202
    """Per case: (no-redundancy output, each placement's output, logical loads from the receive counts)."""
    from deep_ep_npu import sim

    if path != "buffer":
        sim.install()
    results = []
    buffers = {}
    for seed in seeds:
        x, idx, weights = _inputs(info.rank, seed)
        maps = [ExpertMap(default_placement(E, 0), E, info.world_size)]
        maps += [
            ExpertMap(_placement(seed * 7 + i, info.world_size, redundant), E, info.world_size, i % 2) for i in range(2)
        ]
        outs, loads = [], []
        for transport in ("shm", "collective") if path == "buffer" else ("auto",):
            for emap in maps:
                if path == "ops":
                    y, counts = _ops_run(info, emap, x, idx, weights)
                elif path == "elastic":
                    if "elastic" not in buffers:  # (multiple reduction pre-sums a token's rows per rank)
                        buffers["elastic"] = ElasticBuffer(
                            info.group,
                            num_max_tokens_per_rank=N,
                            hidden=H,
                            allow_multiple_reduction=False,
                            explicitly_destroy=True,
                        )
                    y, counts = _elastic_run(info, buffers["elastic"], emap, x, idx, weights)
                else:
                    key = (transport, emap.num_physical)
                    if key not in buffers:
                        backend = "ascend" if path == "ascend" else "reference"
                        tp = None if path == "ascend" else transport
                        buffers[key] = Buffer(info.group, backend=backend, transport=tp, explicitly_destroy=True)
                    y, counts = _buffer_run(info, buffers[key], emap, x, idx, weights, path == "ascend")
                slot_load = torch.zeros(1, emap.num_physical, dtype=torch.int64)
                slot_load[0, info.rank * emap.num_local : (info.rank + 1) * emap.num_local] = counts.long()
                outs.append(y)
                loads.append(emap.load_per_logical(slot_load))
        results.append((outs, loads))
    for b in buffers.values():
        b.destroy()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("path", ["buffer", "ops", "ascend", "elastic"])
def test_redundant_placements_equal_no_redundancy(world_size: int, path: str) -> None:
    seeds = [1, 2]
    redundant = 4 if world_size == 2 else 8  # P = 12 (L = 6) / P = 16 (L = 4)
    per_rank = parallel_launch(world_size, _rank, path, seeds, redundant, timeout=120)
    for case, seed in enumerate(seeds):
        routed = torch.zeros(E, dtype=torch.int64)
        for r in range(world_size):
            idx = _inputs(r, seed)[1]
            routed += torch.bincount(idx[idx >= 0], minlength=E)
        for r in range(world_size):
            outs, _ = per_rank[r][case]
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), f"rank {r}: a placement with replicas changed the combine"
        num_runs = len(per_rank[0][case][1])
        for run in range(num_runs):
            assert torch.equal(sum(per_rank[r][case][1][run][0] for r in range(world_size)), routed)
