"""torch_npu's npu_moe_update_expert (deep_ep_npu.ops.moe_update_expert, and torch_npu.npu_moe_update_expert in the
stand-in) against the formulas of torch_npu's doc of the op, element by element in Python (the OP test's
setup: 8 ranks, BS 128, K 8, 256 logical experts, F 5, both balance modes, pruning with a prefix active mask)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deep_ep_npu import MoeDistributeError
from deep_ep_npu.eplb import default_placement, eplb_table, maps
from deep_ep_npu.ops import moe_update_expert

BS, K, LOG, PHY_RANKS, F, W = 128, 8, 256, 8, 5, 8


def _case(seed: int) -> tuple[torch.Tensor, ...]:
    rng = random.Random(seed)
    rows = []
    for _ in range(LOG):
        count = rng.randint(1, F - 1)
        replicas = rng.sample(range(PHY_RANKS), count)
        rows.append([count, *replicas, *([0] * (F - 1 - count))])
    table = torch.tensor(rows, dtype=torch.int32)
    ids = torch.tensor([[rng.randrange(LOG) for _ in range(K)] for _ in range(BS)], dtype=torch.int32)
    scales = torch.tensor([sorted((rng.uniform(0, 0.25) for _ in range(K)), reverse=True) for _ in range(BS)])
    threshold = torch.tensor([[rng.uniform(0, 0.15) for _ in range(K)]])
    num_true = rng.randint(0, BS)
    active = torch.tensor([i < num_true for i in range(BS)])
    return ids, table, scales, threshold, active


def _golden(ids, table, scales, threshold, active, rank, mode):  # noqa: ANN001, ANN202
    out, mask = torch.zeros(BS, K, dtype=torch.int64), torch.zeros(BS, K, dtype=torch.bool)
    for i in range(BS):
        total = torch.tensor(0.0)
        for j in range(K):
            total = total + scales[i, j]
        for j in range(K):
            e = int(ids[i, j])
            count = int(table[e, 0])
            col = rank // math.ceil(W / count) + 1 if mode == 0 else i % count + 1
            out[i, j] = int(table[e, col])
            mask[i, j] = bool(active[i]) and not bool(scales[i, j] < threshold[0, j] * total)
    return out, mask


@pytest.mark.parametrize("mode", [0, 1])
def test_matches_reference_formulas(mode: int) -> None:
    for rank in (0, 3, 7):
        ids, table, scales, threshold, active = _case(100 * mode + rank)
        prune = {"expert_scales": scales, "pruning_threshold": threshold, "active_mask": active}
        got, mask = moe_update_expert(ids, table, **prune, local_rank_id=rank, world_size=W, balance_mode=mode)
        want, want_mask = _golden(ids, table, scales, threshold, active, rank, mode)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)
        assert torch.equal(mask, want_mask) and mask.any() and not mask.all()


def test_without_pruning_and_through_the_stand_in() -> None:
    from deep_ep_npu import sim

    torch_npu = sim.install()
    try:
        ids, table, *_ = _case(7)
        got, mask = torch_npu.npu_moe_update_expert(ids.long(), table, local_rank_id=5, world_size=W)
        assert got.dtype == torch.int64 and mask.all()
        assert torch.equal(got, moe_update_expert(ids, table, local_rank_id=5, world_size=W)[0].long())
    finally:
        sim.uninstall()


def test_table_from_a_placement() -> None:
    log2phy, _ = maps(default_placement(8, 2), 8)  # experts 0, 1 have slots {0, 8} / {1, 9}
    table = eplb_table(log2phy[0])
    assert table.tolist()[:3] == [[2, 0, 8], [2, 1, 9], [1, 2, 0]]
    ids = torch.tensor([[0, 1], [0, 2]])
    assert moe_update_expert(ids, table, balance_mode=1)[0].tolist() == [[0, 1], [8, 2]]
    assert moe_update_expert(ids, table, local_rank_id=1, world_size=2)[0].tolist() == [[8, 9], [8, 2]]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"balance_mode": 2}, "balance_mode"),
        ({"local_rank_id": 2, "world_size": 2}, "local_rank_id"),
        ({"expert_scales": torch.ones(1, 2)}, "pruning_threshold"),
        ({"active_mask": torch.ones(1, dtype=torch.bool)}, "expert_scales"),
        ({"ids": torch.tensor([[0, 9]])}, "expert_ids"),
    ],
)
def test_bad_input(kwargs: dict, param: str) -> None:
    table = eplb_table(maps(default_placement(8, 0), 8)[0][0])
    ids = kwargs.pop("ids", torch.tensor([[0, 1]]))
    kwargs.setdefault("local_rank_id", 0)
    kwargs.setdefault("world_size", 2)
    with pytest.raises(MoeDistributeError) as err:
        moe_update_expert(ids, table, **kwargs)
    assert err.value.param == param
