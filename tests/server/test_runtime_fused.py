"""The serving runtime's fused MoE path (``moe_impl="fused"``: ``Buffer.mega_moe`` in every MoE layer) gives the
same greedy tokens as transformers on the same checkpoint (fp32), like the unfused path."""

from __future__ import annotations

import pytest

from server import LLM, SamplingParams
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint

STEPS = 8
PROMPTS = [[(5 * i + 2 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 12, 1, 20])]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fused_moe_serving_matches_transformers(tmp_path, arch: str) -> None:
    path = make_checkpoint(arch, str(tmp_path))
    hf = load_hf(path)
    golden = [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    with LLM(
        model=path, ep_size=2, moe_impl="fused", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64
    ) as llm:
        outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == golden


def test_fused_rejects_int8_experts() -> None:
    with pytest.raises(ValueError, match="moe_impl='fused'"):
        LLM(model=None, ep_size=1, moe_impl="fused", int8_experts=True)


def test_fused_refuses_biased_experts_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss' experts (biases, clamped SwiGLU) cannot run fused: a clear error at start-up, no worker started."""
    from server.runtime import engine

    def no_workers(*args: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(engine, "ProcessWorkers", no_workers)
    with pytest.raises(ValueError, match="moe_impl='fused'.*gpt_oss's experts need the unfused path"):
        LLM(model=None, random_model={"architecture": "gpt_oss"}, ep_size=2, moe_impl="fused")
