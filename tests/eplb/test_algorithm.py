"""DeepSeek's EPLB (deep_ep_npu.eplb.rebalance_experts) against the published worked example (DeepSeek's README,
https://github.com/deepseek-ai/EPLB: 2 layers, 12 experts, 4 groups, 16 replicas, 2 nodes x 8 GPUs) and the properties
an EPLB implementation's tests check (vLLM's and SGLang's EPLB tests)."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import MoeDistributeError
from deep_ep_npu.eplb import balancedness, default_placement, maps, rank_loads, rebalance_experts

WEIGHT = torch.tensor(
    [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
)


def test_readme_example_hierarchical() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape == (2, 12, 2)
    layer0 = log2phy[0].tolist()  # replica order as created, not slot order
    assert (layer0[0], layer0[1], layer0[4], layer0[5], layer0[10]) == ([12, -1], [15, 13], [7, 5], [0, 2], [8, 10])
    gpu = rank_loads(WEIGHT, phy2log, 8)
    assert gpu[0].tolist() == [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152]
    assert gpu[1].tolist() == [173, 179.5, 120.5, 172, 123, 152, 118.5, 117.5]
    assert [round(b, 3) for b in balancedness(gpu).tolist()] == [0.828, 0.805]


def test_readme_example_global_and_baseline() -> None:
    phy2log, _, _ = rebalance_experts(WEIGHT, 16, 3, 2, 8)  # 3 % 2 != 0: the global policy
    assert [round(b, 3) for b in balancedness(rank_loads(WEIGHT, phy2log, 8)).tolist()] == [0.932, 0.840]
    contiguous = rank_loads(WEIGHT, default_placement(12, 0, 2), 4)
    assert [round(b, 3) for b in balancedness(contiguous).tolist()] == [0.783, 0.560]


def test_log2phy_consistent_with_phy2log() -> None:
    torch.manual_seed(0)
    weight = torch.randint(0, 1000, (3, 16))
    phy2log, log2phy, logcnt = rebalance_experts(weight, 24, 4, 2, 4)
    assert (logcnt >= 1).all() and (logcnt.sum(1) == 24).all() and log2phy.shape[2] == int(logcnt.max())
    for layer in range(3):
        for e in range(16):
            slots = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert len(slots) == logcnt[layer, e] and all(phy2log[layer, s] == e for s in slots)
    assert sorted(maps(phy2log, 16)[0][0].flatten().tolist()) == sorted(log2phy[0].flatten().tolist())


def test_equal_weights_and_hot_expert() -> None:
    _, _, logcnt = rebalance_experts(torch.ones(1, 8), 8, 1, 1, 4)
    assert logcnt.tolist() == [[1] * 8]
    hot = torch.ones(1, 8)
    hot[0, 3] = 1000
    _, _, logcnt = rebalance_experts(hot, 12, 1, 1, 4)
    assert logcnt[0, 3] == 5 and int(logcnt.sum()) == 12


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ((17, 4, 2, 8), "num_replicas"),
        ((16, 5, 2, 8), "num_groups"),
        ((16, 4, 3, 8), "num_ranks"),
        ((8, 4, 2, 8), "num_replicas"),
    ],
)
def test_bad_arguments(args: tuple[int, int, int, int], param: str) -> None:
    with pytest.raises(MoeDistributeError) as err:
        rebalance_experts(WEIGHT, *args)
    assert err.value.param == param
