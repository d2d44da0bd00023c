"""Driver-side pieces without workers: per-rank scheduling (chunked prefill, blocks, preemption), the prefix cache,
stop handling, sampling."""

from __future__ import annotations

import pytest
import torch

from server.engine_api import SamplingParams
from server.runtime.sampling.sampler import sample_one
from server.runtime.scheduling.block_manager import BlockTable, KVCacheManager
from server.runtime.scheduling.detokenizer import IncrementalDetokenizer
from server.runtime.scheduling.request import Request, apply_token
from server.runtime.scheduling.scheduler import RankScheduler
from server.tokenizer import ByteTokenizer


def _request(name: str, tokens: list[int], seq_id: int = 0, **params) -> Request:  # noqa: ANN003
    tok = ByteTokenizer(eos_token_ids=[256])
    return Request(name, seq_id, len(tokens), list(tokens), SamplingParams(**params), IncrementalDetokenizer(tok))


def test_chunked_prefill_decode_first_and_blocks() -> None:
    """Decodes first, then prefill chunks within the per-step capacity, admission by slots; each entry carries the
    blocks its sequence gained (the whole table on a fresh start)."""
    s = RankScheduler(KVCacheManager(num_blocks=16, block_size=4), max_num_seqs=2, num_max_tokens=8, max_model_len=64)
    a, b, c = (_request(n, list(range(1, k + 1)), i) for i, (n, k) in enumerate((("a", 11), ("b", 3), ("c", 2))))
    s.waiting.extend([a, b, c])
    plan, sampling = s.schedule()  # a takes the whole budget (first chunk), b waits for budget, c for a slot
    assert [(e.seq_id, e.start, len(e.token_ids or []), e.sample) for e in plan.entries] == [(0, 0, 8, False)]
    assert plan.entries[0].params is a.params and sampling == []
    assert (len(plan.entries[0].new_block_ids), plan.entries[0].reset_blocks) == (2, True)
    plan, sampling = s.schedule()  # a's last 3 prompt tokens (one more block), then b's prompt
    assert [(e.seq_id, e.start, e.token_ids, e.sample) for e in plan.entries] == [
        (0, 8, [9, 10, 11], True),
        (1, 0, [1, 2, 3], True),
    ]
    assert [(len(e.new_block_ids), e.reset_blocks) for e in plan.entries] == [(1, False), (1, True)]
    assert plan.entries[0].params is None and sampling == [a, b]
    assert plan.entries[1].new_block_ids[0] not in a.table.blocks  # blocks are not shared between requests
    plan, _ = s.schedule()  # async: a and b decode the tokens still in flight (placeholders)
    assert [(e.seq_id, e.start, e.token_ids) for e in plan.entries] == [(0, 11, None), (1, 3, None)]
    for req in (a, b):
        req.num_inflight -= 2  # both steps' tokens arrive
        req.token_ids += [50, 51]
    s.remove(a)
    plan, _ = s.schedule()
    assert [(e.seq_id, e.token_ids) for e in plan.entries] == [(1, [51]), (2, [1, 2])]  # c takes a's slot
    assert plan.entries[1].params is c.params


def test_preemption_when_blocks_run_out() -> None:
    """Two requests, blocks for 5 tokens: the later one is preempted (blocks released, back to the head of the
    queue) and recomputed from its prompt and output when the first one finishes."""
    s = RankScheduler(
        KVCacheManager(num_blocks=5, block_size=1, enable_prefix_caching=False),
        max_num_seqs=2,
        num_max_tokens=8,
        max_model_len=5,
    )
    a, b = _request("a", [1, 2], 0), _request("b", [3], 1)
    s.waiting.extend([a, b])
    plan, _ = s.schedule()
    assert [e.seq_id for e in plan.entries] == [0, 1] and s.kv.pool.num_free == 2
    a.token_ids.append(7)
    b.token_ids.append(8)
    a.num_inflight = b.num_inflight = 0
    s.schedule()  # a and b decode: 5 blocks in use
    a.token_ids.append(9)
    b.token_ids.append(10)
    a.num_inflight = b.num_inflight = 0
    plan, _ = s.schedule()  # a needs a 6th block: b (admitted last) is preempted
    assert [(e.seq_id, e.token_ids) for e in plan.entries] == [(0, [9])]
    assert list(s.waiting) == [b] and b.num_computed == 0 and b.table.blocks == [] and s.num_preemptions == 1
    s.remove(a)
    plan, _ = s.schedule()  # b starts over: prompt and output as one prefill, on a fresh block table
    assert [(e.seq_id, e.start, e.token_ids, e.sample, e.reset_blocks) for e in plan.entries] == [
        (1, 0, [3, 8, 10], True, True)
    ]


def test_prefix_cache_hits_share_full_blocks_and_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    first, second = BlockTable(), BlockTable()
    prompt = [1, 2, 3, 4, 5, 6]
    assert kv.admit(first, prompt, 8) == 0
    kv.cache_full_blocks(first, prompt, 6)
    assert kv.admit(second, prompt + [7], 8) == 6  # three full blocks shared; the last token is never a hit
    assert second.blocks[:3] == first.blocks and kv.pool.ref_count[first.blocks[0]] == 2
    assert (kv.num_queries, kv.num_hits) == (6 + 7, 6)
    third = BlockTable()
    assert kv.admit(third, prompt, 8) == 4  # a whole-prompt hit keeps its last block to recompute
    assert kv.match_prefix([1, 2, 9, 9, 9]) == ([first.blocks[0]], [first.key_ids[0]])  # chained: same head only
    assert kv.match_prefix([9, 9, 3, 4, 5]) == ([], [])  # a block matches only after the same prefix
    cached = first.blocks
    for table in (first, second, third):
        kv.free(table)
    assert kv.usage == 0.0 and kv.match_prefix(prompt + [0])[0] == cached  # still cached while unused
    kv.grow(BlockTable(), 2 * 5)  # five blocks taken: least recently freed first, a prefix's tail before its head
    assert kv.match_prefix(prompt + [0])[0] == cached[:1]


def test_apply_token_stop_semantics() -> None:
    r = _request("r", [1, 2, 3], max_tokens=10)
    assert apply_token(r, ord("h"), 100).finish_reason is None
    d = apply_token(r, 256, 100)
    assert (d.finish_reason, d.text, r.output_token_ids) == ("stop", "h", [ord("h"), 256])
    r = _request("r", [1, 2, 3], max_tokens=10, ignore_eos=True)
    assert apply_token(r, 256, 100).finish_reason is None
    r = _request("r", [1, 2, 3], max_tokens=10, stop_token_ids=[ord("x")])
    d = apply_token(r, ord("x"), 100)
    assert (d.finish_reason, d.text) == ("stop", "")
    r = _request("r", [1, 2, 3], max_tokens=10, stop=["lo", "el"])
    for ch in "hel":
        d = apply_token(r, ord(ch), 100)
    assert (d.finish_reason, d.text) == ("stop", "h")  # earliest stop string wins, cut with what follows
    r = _request("r", [1, 2, 3], max_tokens=2)
    apply_token(r, 65, 100)
    assert apply_token(r, 66, 100).finish_reason == "length"
    r = _request("r", [1, 2, 3], max_tokens=50)
    assert apply_token(r, 65, 5).finish_reason is None
    assert apply_token(r, 65, 5).finish_reason == "length"  # 3 prompt + 2 output = max_model_len


def test_sampler_greedy_top_k_top_p_and_seed() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -5.0, 0.0])
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert sample_one(logits, SamplingParams(temperature=0), gen(0)) == 1
    draws = {sample_one(logits, SamplingParams(temperature=1.0, top_k=2), gen(s)) for s in range(200)}
    assert draws == {1, 2}
    # p(1) ~ 0.49, p(2) ~ 0.44: top_p 0.5 keeps tokens 1 and 2 (the set reaching 0.5), 0.3 keeps only token 1
    assert {sample_one(logits, SamplingParams(temperature=1.0, top_p=0.5), gen(s)) for s in range(200)} == {1, 2}
    assert {sample_one(logits, SamplingParams(temperature=1.0, top_p=0.3), gen(s)) for s in range(50)} == {1}
    full = [sample_one(logits, SamplingParams(temperature=1.0), gen(s)) for s in range(400)]
    assert set(full) == {0, 1, 2, 4}
    assert full == [sample_one(logits, SamplingParams(temperature=1.0), gen(s)) for s in range(400)]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_sampler_min_p_bias_penalties_and_logprobs() -> None:
    from server.runtime.sampling.request_sampler import RequestSampler

    logits = torch.tensor([1.0, 3.0, 2.9, -5.0, 0.0])
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    # probabilities at T=1: [.063, .467, .423, .0003, .023]; min_p 0.2 keeps tokens with p >= 0.093: 1 and 2
    assert {sample_one(logits, SamplingParams(temperature=1.0, min_p=0.2), gen(s)) for s in range(200)} == {1, 2}
    assert sample_one(logits, SamplingParams(temperature=0, logit_bias={3: 9.0}), gen(0)) == 3  # -5 + 9 > 3
    assert sample_one(logits, SamplingParams(temperature=0, logit_bias={1: 1e9}), gen(0)) == 1  # clamped to 100
    sampler = RequestSampler(SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=2.0), gen(0), 5)
    sampler.feed([1, 3], None)  # prompt tokens: 3 -> 1.5 (divided), -5 -> -10 (multiplied)
    _, logprob, prompt = sampler.sample(logits)
    want = torch.log_softmax(torch.tensor([1.0, 1.5, 2.9, -10.0, 0.0]) / 0.5, dim=-1)  # penalty, then temperature
    assert prompt is None and logprob is not None
    assert logprob.logprob == pytest.approx(float(want[logprob.token_id]), abs=1e-6)
    assert [t for t, _ in logprob.top] == [2, 1] and [v for _, v in logprob.top] == pytest.approx(
        [float(want[2]), float(want[1])], abs=1e-6
    )
    for param, value in [
        ("presence_penalty", 2.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("n", 0),
        ("logit_bias", {-1: 1.0}),
    ]:
        with pytest.raises(ValueError, match=f"^{param}: "):
            SamplingParams(**{param: value})


def test_sample_seeds_and_prompt_logprobs_across_chunks() -> None:
    from server.runtime.sampling.request_sampler import RequestSampler

    assert [SamplingParams(seed=2**64 - 2, n=3).for_sample(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert SamplingParams(n=3).for_sample(2).seed is None and SamplingParams(n=3).for_sample(2).n == 1
    rows = torch.randn(5, 7)  # the model's logits after tokens 0..4 of the prompt [4, 6, 1, 0, 2]
    sampler = RequestSampler(SamplingParams(temperature=0, prompt_logprobs=1), torch.Generator(), 7)
    assert sampler.wants_all_logits
    sampler.feed([4, 6, 1], rows[:3])  # two prefill chunks: 3 + 2 tokens
    sampler.feed([0, 2], rows[3:])
    token, _, prompt = sampler.sample(rows[4])
    assert token == int(rows[4].argmax()) and not sampler.wants_all_logits
    want = torch.log_softmax(rows, dim=-1)  # the prompt token after row i is scored by row i
    assert prompt is not None and prompt[0] is None
    assert [p.logprob for p in prompt[1:]] == pytest.approx([float(want[i, t]) for i, t in enumerate([6, 1, 0, 2])])


def test_kv_cache_memory_spellings_and_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.cli import parse_config
    from server.config import parse_bytes
    from server.runtime.scheduling import kv_budget

    assert [parse_bytes(v) for v in ("4G", "4g", "4GiB", "4GB", "1k", "1K", "1.5M", 123)] == [
        4 * 2**30,
        4 * 10**9,
        4 * 2**30,
        4 * 10**9,
        1000,
        1024,
        int(1.5 * 2**20),
        123,
    ]
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("4 apples")
    assert parse_config(["--kv-cache-memory", "2G"]).kv_cache_memory == 2 * 2**30
    assert kv_budget.kv_budget_bytes(torch.device("cpu"), 5000, 0.9, 2, 10**9, lambda: 0) == (
        5000,
        "kv-cache-memory 0.0 MiB",
    )
    budget, why = kv_budget.kv_budget_bytes(torch.device("cpu"), None, 0.9, 2, 12345, lambda: 0)
    assert budget == 12345 and "capped at max-num-seqs" in why  # host memory far above the cap
    small, _ = kv_budget.kv_budget_bytes(torch.device("cpu"), None, 1e-9, 1, 10**15, lambda: 0)
    assert 0 <= small < 2 * 1e-9 * kv_budget.host_memory_available()
    # an accelerator: utilization x total, less what is in use and the activation peak
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device: (600 * 2**20, 1000 * 2**20))
    budget, why = kv_budget.kv_budget_bytes(torch.device("cuda"), None, 0.9, 1, 0, lambda: 100 * 2**20)
    assert budget == (900 - 400 - 100) * 2**20 and "less 400.0 MiB in use" in why
