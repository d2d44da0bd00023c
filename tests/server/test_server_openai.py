"""The official ``openai`` client against the real EP runtime (2 spawned workers) on real uvicorn.

Oracle: HF transformers on the same tiny checkpoint. Log-probabilities are checked against its log-softmax, and
penalized greedy decoding against a greedy loop over its logits with the penalties applied here, by vLLM's
definitions (repetition: positive logits divided, negative multiplied, for prompt and output tokens; frequency:
minus penalty x count of the token in the output; presence: minus penalty once if the token is in the output).
"""

from __future__ import annotations

import collections
import logging

import openai
import pytest
import torch

from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.support.tiny_moe import real_server

TOL = 2e-4  # fp32 log-probabilities of two implementations of one model
GREEDY = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def hf_and_server(tmp_path_factory):
    path = make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen")))
    with real_server(model=path, **{"served-model-name": "tiny"}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield load_hf(path), srv, client


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float64: row i is the distribution of the token after ``ids[: i + 1]``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def _penalized_greedy(
    hf,
    prompt: list[int],
    steps: int,
    frequency: float = 0.0,
    presence: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        for token, b in (bias or {}).items():
            logits[token] += b
        for token in set(prompt) | set(out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token, count in collections.Counter(out).items():
            logits[token] -= frequency * count + presence
        out.append(int(logits.argmax()))
    return out


def test_n_samples_each_with_its_own_seed_stream(hf_and_server):
    _, _, client = hf_and_server
    r = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=6, n=3, seed=11, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):  # sample i draws from seed + i, as vLLM
        one = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=6, seed=11 + i, temperature=1.0, extra_body={"ignore_eos": True}
        )
        assert choice.text == one.choices[0].text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 18


def test_prompt_batch_choice_index_is_prompt_times_n_plus_sample(hf_and_server):
    hf, _, client = hf_and_server
    prompts = [[1, 2, 3], [9, 8]]
    r = client.completions.create(**GREEDY, prompt=prompts, max_tokens=4, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.model_extra["token_ids"] == hf_greedy(hf, prompts[c.index // 2], 4)[0]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 16
    two = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=2, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]


def test_chat_top_logprobs_match_the_oracle_and_greedy_choice(hf_and_server):
    hf, _, client = hf_and_server
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(**GREEDY, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    prompt, tokens = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    rows = _log_softmax(hf, prompt + tokens)[len(prompt) - 1 :]
    content = choice.logprobs.content
    assert len(content) == len(tokens) == 5
    for j, entry in enumerate(content):
        assert len(entry.top_logprobs) == 2
        values = [t.logprob for t in entry.top_logprobs]
        assert values[0] >= values[1] and entry.logprob == pytest.approx(values[0], abs=1e-6)  # greedy: the best
        assert entry.logprob == pytest.approx(float(rows[j, tokens[j]]), abs=TOL)
        assert values == pytest.approx(rows[j].topk(2).values.tolist(), abs=TOL)
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_with_echo_cover_prompt_and_output(hf_and_server):
    hf, _, client = hf_and_server
    prompt = [(3 * i) % 120 + 1 for i in range(80)]  # over the step's 64-token capacity: two prefill chunks
    r = client.completions.create(**GREEDY, prompt=prompt, max_tokens=3, logprobs=1, echo=True)
    choice = r.choices[0]
    tokens = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = _log_softmax(hf, prompt + tokens)
    want = [float(rows[i - 1, t]) for i, t in enumerate(prompt + tokens) if i > 0]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # the best token, plus the actual one if other
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert choice.text.startswith(bytes(prompt).decode())


def test_streamed_logprobs_equal_the_full_response(hf_and_server):
    _, _, client = hf_and_server
    body = dict(model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    full = client.completions.create(**body).choices[0].logprobs
    chunks = [c for c in client.completions.create(**body, stream=True) if c.choices]
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.token_logprobs, abs=1e-6) and len(streamed) == 6
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == full.text_offset


def test_streamed_chat_logprobs_equal_the_full_response(hf_and_server):
    _, _, client = hf_and_server
    body = dict(
        model="tiny",
        messages=[{"role": "user", "content": "yo"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**body).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, len(t.top_logprobs)) for t in streamed] == [(t.token, 1) for t in full] and len(full) == 4
    # (the second request's prompt may come from the prefix cache: its last token then runs as a decode, whose
    # attention kernel sums in another order than the prefill's torch ops, ~1e-7 apart in fp32)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full], abs=1e-5)


def test_defaults_clients_send_and_unknown_fields_are_accepted(hf_and_server, caplog):
    _, _, client = hf_and_server
    with caplog.at_level(logging.WARNING, logger="server.api"):
        for _ in range(2):
            r = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                presence_penalty=0,
                frequency_penalty=0,
                logprobs=False,
                response_format={"type": "text"},
                tool_choice="none",
                metadata={"k": "v"},
                extra_body={"some_unknown_field": 1},
            )
            assert r.choices[0].message.role == "assistant" and r.choices[0].logprobs is None
    warned = [rec.getMessage() for rec in caplog.records if "some_unknown_field" in rec.getMessage()]
    assert len(warned) == 1  # once per field name


def test_unsupported_values_raise_bad_request(hf_and_server):
    _, _, client = hf_and_server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=tools)
    assert e.value.body["param"] == "tool_choice"  # "auto" (the default with tools) needs --enable-auto-tool-choice
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", best_of=3, n=1)
    assert e.value.body["param"] == "best_of"


def test_models_retrieve(hf_and_server):
    _, _, client = hf_and_server
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_frequency_penalty_stops_a_token_greedy_repeats(hf_and_server):
    hf, _, client = hf_and_server
    steps = 16
    for i in range(1, 60):  # a prompt whose greedy continuation repeats a token (the oracle finds it)
        prompt = [i, i + 1, i + 2]
        greedy = hf_greedy(hf, prompt, steps)[0]
        token, count = collections.Counter(greedy).most_common(1)[0]
        if count >= 3:
            break
    else:
        pytest.fail("no prompt in range repeats a token under greedy decoding")

    def served(**penalties: object) -> list[int]:
        extra = {"ignore_eos": True, "return_token_ids": True, **penalties}
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=steps, temperature=0, extra_body=extra)
        return r.choices[0].model_extra["token_ids"]

    assert served() == greedy
    penalized = served(frequency_penalty=2.0)
    assert penalized == _penalized_greedy(hf, prompt, steps, frequency=2.0)
    assert penalized.count(token) < count
    # presence -1.5 invites a first repeat, frequency 0.5 per occurrence then pushes the token away: counts reach
    # 2 and 3, where "presence once" and "presence per occurrence" pick different tokens
    repeats = served(presence_penalty=-1.5, frequency_penalty=0.5)
    assert repeats == _penalized_greedy(hf, prompt, steps, presence=-1.5, frequency=0.5)
    assert max(collections.Counter(repeats).values()) >= 3
    mixed = dict(presence_penalty=0.7, repetition_penalty=1.3, logit_bias={str(greedy[0]): -100})
    want = _penalized_greedy(hf, prompt, steps, presence=0.7, repetition=1.3, bias={greedy[0]: -100.0})
    assert served(**mixed) == want and want[0] != greedy[0]


def test_tokenize_detokenize_round_trip(hf_and_server):
    import httpx

    _, srv, _ = hf_and_server
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        t = c.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
        assert t["tokens"] == list("héllo".encode()) and t["count"] == 6 and t["max_model_len"] == 512
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == list(b"user: hi\nassistant:")
        assert c.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
        err = c.post("/detokenize", json={"tokens": [1, 256]}).json()["error"]
        assert err["param"] == "tokens" and "vocab_size" in err["message"]
