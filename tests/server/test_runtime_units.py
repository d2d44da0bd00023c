"""Driver-side pieces without workers: per-rank scheduling (chunked prefill, slots), stop handling, sampling."""

from __future__ import annotations

import pytest
import torch

from server.engine_api import SamplingParams
from server.runtime.sampler import sample_one
from server.runtime.scheduler import RankScheduler, Request, apply_token
from server.tokenizer import ByteTokenizer


def test_chunked_prefill_decode_first_and_slots() -> None:
    s = RankScheduler(max_num_seqs=2, num_max_tokens=8)
    a, b, c = (
        Request(n, list(range(1, k + 1)), SamplingParams())
        for n, k in (
            (
                "a",
                11,
            ),
            ("b", 3),
            ("c", 2),
        )
    )
    s.waiting.extend([a, b, c])
    plan, sampling = s.schedule()  # a takes the whole budget (first chunk), b waits for budget, c for a slot
    assert [(e.slot, e.start, len(e.token_ids), e.sample) for e in plan.entries] == [(0, 0, 8, False)]
    assert plan.entries[0].params is a.params and sampling == []
    plan, sampling = s.schedule()  # a's last 3 prompt tokens, then b's prompt
    assert [(e.slot, e.start, e.token_ids, e.sample) for e in plan.entries] == [
        (0, 8, [9, 10, 11], True),
        (1, 0, [1, 2, 3], True),
    ]
    assert plan.entries[0].params is None and sampling == [a, b]
    a.output_token_ids.append(50)
    b.output_token_ids.append(60)
    plan, _ = s.schedule()  # both decode one token each; c still has no slot
    assert [(e.slot, e.start, e.token_ids) for e in plan.entries] == [(0, 11, [50]), (1, 3, [60])]
    s.remove(a)
    b.output_token_ids.append(61)
    plan, _ = s.schedule()
    assert [(e.slot, e.token_ids) for e in plan.entries] == [(1, [61]), (0, [1, 2])]  # c reuses a's slot
    assert plan.entries[1].params is c.params


def _req(**kw) -> Request:  # noqa: ANN003
    return Request("r", [1, 2, 3], SamplingParams(**kw))


def test_apply_token_stop_semantics() -> None:
    tok = ByteTokenizer(eos_token_ids=[256])
    r = _req(max_tokens=10)
    assert apply_token(r, ord("h"), tok, 100).finish_reason is None
    d = apply_token(r, 256, tok, 100)
    assert (d.finish_reason, d.text, r.output_token_ids) == ("stop", "h", [ord("h"), 256])
    r = _req(max_tokens=10, ignore_eos=True)
    assert apply_token(r, 256, tok, 100).finish_reason is None
    r = _req(max_tokens=10, stop_token_ids=[ord("x")])
    d = apply_token(r, ord("x"), tok, 100)
    assert (d.finish_reason, d.text) == ("stop", "")
    r = _req(max_tokens=10, stop=["lo", "el"])
    for ch in "hel":
        d = apply_token(r, ord(ch), tok, 100)
    assert (d.finish_reason, d.text) == ("stop", "h")  # earliest stop string wins, cut with what follows
    r = _req(max_tokens=2)
    apply_token(r, 65, tok, 100)
    assert apply_token(r, 66, tok, 100).finish_reason == "length"
    r = _req(max_tokens=50)
    assert apply_token(r, 65, tok, 5).finish_reason is None
    assert apply_token(r, 65, tok, 5).finish_reason == "length"  # 3 prompt + 2 output = max_model_len


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
    from server.runtime.request_sampler import RequestSampler

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
    for param, value in [("presence_penalty", 2.5), ("min_p", -0.1), ("repetition_penalty", 0.0), ("logprobs", 21),
                         ("n", 0), ("logit_bias", {-1: 1.0})]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{param}: "):
            SamplingParams(**{param: value})


def test_sample_seeds_and_prompt_logprobs_across_chunks() -> None:
    from server.runtime.request_sampler import RequestSampler

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
