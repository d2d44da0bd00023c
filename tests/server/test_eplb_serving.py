"""Expert load balancing in the serving layer: redundant experts (--num-redundant-experts), a static placement
(--expert-placement, vllm-ascend's JSON) and EPLB rebalancing mid-generation (--eplb) leave greedy tokens exactly
as without them (replicas are copies; combine sums each token's slots in k order), and bad placements stop
start-up with a clear error."""

from __future__ import annotations

import json

import pytest

from deep_ep_npu.eplb import placement_json
from server.engine_api import SamplingParams
from server.runtime import EngineConfig
from server.runtime.llm import LLM
from tests.support.tiny_moe import MODEL

ENGINE = {"random_model": MODEL, "max_num_seqs": 4, "max_model_len": 128, "backend": "reference"}
PROMPTS = [[7, 3, 9, 1], [100, 42, 5], [1, 2, 3, 4, 5, 6]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tokens(**kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(ep_size=2, **{**ENGINE, **kwargs})  # type: ignore[arg-type]
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm
    finally:
        llm.shutdown()


def test_redundancy_placement_and_eplb_keep_greedy_tokens(tmp_path) -> None:  # noqa: ANN001
    import torch

    base, _ = _tokens()
    assert len({tuple(t) for t in base}) > 1
    redundant, _ = _tokens(num_redundant_experts=2)
    # a static placement: experts shuffled, 0 and 5 twice, two replicas of 5 on one rank
    rows = torch.tensor([[5, 0, 3, 5, 7, 1, 2, 6, 0, 4, 7, 3], [0, 1, 2, 3, 4, 5, 6, 7, 1, 1, 1, 1]])
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_json(rows, 2)))
    placed, _ = _tokens(expert_placement=str(path), num_redundant_experts=4)
    rebalanced, _ = _tokens(num_redundant_experts=2, eplb=True, eplb_interval=5, eplb_window=4)
    assert redundant == base and placed == base and rebalanced == base


def test_on_the_npu_stand_in() -> None:
    """The same on the Buffer's Ascend backend over deep_ep_npu.sim (torch_npu's _v2 ops, P = E + R experts)."""
    npu = {"backend": "ascend", "simulate_npu": True}
    base, _ = _tokens(**npu)
    assert _tokens(**npu, num_redundant_experts=2, eplb=True, eplb_interval=4, eplb_window=4)[0] == base


def test_experts_need_not_divide_by_the_ep_size() -> None:
    """9 experts at EP 2: refused without a placement, served with one redundant slot (P = 10), with the tokens of
    the single-process run (every expert local)."""
    nine = {**ENGINE, "random_model": {**MODEL, "num_experts": 9}}
    with pytest.raises(ValueError, match="ep_size=2 must divide the model's num_experts=9"):
        LLM(ep_size=2, **nine)
    with LLM(ep_size=1, **nine) as llm:
        local = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(ep_size=2, num_redundant_experts=1, **nine) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == local


def test_bad_placements_stop_start_up(tmp_path) -> None:  # noqa: ANN001
    import torch

    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement_json(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 2), 2)))
    with pytest.raises(ValueError, match="num_redundant_experts=4; make them agree"):
        LLM(ep_size=2, **ENGINE, expert_placement=str(path), num_redundant_experts=4)
    with pytest.raises(ValueError, match=r"must be a multiple of the EP size 2"):
        LLM(ep_size=2, **ENGINE, num_redundant_experts=3)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="expert placement .*bad.json"):
        EngineConfig(ep_size=2, expert_placement=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="need expert parallelism"):
        EngineConfig(ep_size=1, num_redundant_experts=2)
