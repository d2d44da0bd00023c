"""ExpertMap: logical -> physical routing with -1 ids, a lost rank's slots dropped (experts with a surviving replica
re-routed, the others dropped and reported), per-logical load from per-slot counts; the server's balancedness
metric (mean / max over workers per MoE layer)."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import MoeDistributeError
from deep_ep_npu.eplb import ExpertMap, default_placement


def test_routing_and_lost_ranks() -> None:
    emap = ExpertMap(default_placement(6, 2), 6, 4)  # P = 8, L = 2: rank 3 holds the replicas of experts 0, 1
    ids = torch.tensor([[0, 1], [0, -1], [5, 1], [0, 4]])
    assert emap.to_physical(0, ids, 0).tolist() == [[0, 1], [6, -1], [5, 1], [6, 4]]  # by token: replica t % 2
    survivors, lost = emap.without_ranks({0})  # rank 0 held experts 0, 1: both have a replica on rank 3
    assert lost == [[]] and survivors.to_physical(0, ids, 1).tolist() == [[6, 7], [6, -1], [5, 7], [6, 4]]
    survivors, lost = emap.without_ranks({2})  # experts 4, 5: no other replica, dropped
    assert lost == [[4, 5]] and survivors.to_physical(0, ids, 1).tolist() == [[0, 1], [6, -1], [-1, 1], [6, -1]]
    counts = torch.arange(8).unsqueeze(0)  # per slot
    assert emap.load_per_logical(counts).tolist() == [[0 + 6, 1 + 7, 2, 3, 4, 5]]


def test_invalid_placements() -> None:
    with pytest.raises(MoeDistributeError, match=r"places no replica of experts \[5\]"):
        ExpertMap(torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]), 6, 4)
    with pytest.raises(MoeDistributeError, match="a multiple of 4 ranks"):
        ExpertMap(torch.tensor([[0, 1, 2, 3, 4, 5]]), 6, 4)


def test_balancedness_metric() -> None:
    from server.metrics import Metrics

    m = Metrics("m")
    m.on_expert_load({0: [10, 4], 1: [30, 4]}, 0)
    m.on_expert_load({0: [10, 4], 1: [30, 4]}, 2)
    text = m.render().decode()
    assert 'expert_load_balancedness{layer="0",model_name="m"} 0.6666' in text  # mean 40 / max 60
    assert 'expert_load_balancedness{layer="1",model_name="m"} 1.0' in text
    assert 'expert_load_total{model_name="m",rank="1"} 68.0' in text and 'experts_lost{model_name="m"} 2.0' in text
