"""EPLB balances a skewed load: a 64-expert model at EP 4 whose routing is Zipf-skewed (s = 1.2, top-8; the hot
experts all start on worker 0). Per MoE layer, balancedness = mean / max over workers of the rows their experts
received (the engine's per-step expert loads, summed): without EPLB it stays low; with --eplb (rebalanced every 8
steps from the last 8) it is >= 0.9 over the steps after the first rebalance."""

from __future__ import annotations

from server.engine_api import SamplingParams
from server.runtime import EPEngine
from tests.support.tiny_moe import qwen3_moe

MODEL = qwen3_moe(num_experts=64, num_experts_per_tok=8, routing_skew=1.2)
INTERVAL = 8


def balancedness(**kwargs: object) -> list[float]:
    """Per MoE layer, over the decode steps after step ``INTERVAL + 1``."""
    engine = EPEngine(ep_size=4, random_model=MODEL, max_num_seqs=8, max_model_len=128, backend="reference", **kwargs)  # type: ignore[arg-type]
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i in range(16):
            engine.add_request(str(i), [1 + i, 2, 3], params)
        totals: dict[int, list[int]] = {}
        step = 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            if step <= INTERVAL + 1:
                continue
            for rank, per_layer in engine.last_step_stats().expert_loads.items():
                row = totals.setdefault(rank, [0] * len(per_layer))
                for layer, n in enumerate(per_layer):
                    row[layer] += n
    finally:
        engine.shutdown()
    assert sorted(totals) == [0, 1, 2, 3]
    columns = list(zip(*totals.values(), strict=True))
    return [sum(c) / len(c) / max(c) for c in columns]


def test_eplb_balances_a_zipf_load() -> None:
    before = balancedness()
    after = balancedness(num_redundant_experts=4, eplb=True, eplb_interval=INTERVAL, eplb_window=INTERVAL)
    print(f"balancedness per layer without EPLB {before}, with {after}")
    assert max(before) < 0.7 and min(after) >= 0.9
