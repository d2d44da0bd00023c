"""The HTTP layer over a deterministic fake engine, on real uvicorn (loopback) with an httpx client.

Expected outputs come from ``expected_token_ids`` (the fake's closed form), never from the server's own state.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server.api import create_app
from server.config import build_config
from tests.support.serving import FakeEngine, UvicornThread, expected_token_ids

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def _text(ids: list[int]) -> str:
    return bytes(ids).decode()


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(num_ranks=2, max_num_seqs=4, max_model_len=128, step_time=0.002)
    config = build_config({"max-tokens-limit": 64, "served-model-name": "tiny"})
    with UvicornThread(create_app(config, engine)) as srv:
        srv.engine = engine
        yield srv
    assert engine.shut_down  # the app's lifespan shut the engine down


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def sse_events(text: str) -> list[str]:
    """Split an SSE body into event payloads, checking the framing (``data: ...`` + blank line)."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def stream_chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def test_completion_string_prompt_with_token_ids(client):
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 7, "return_token_ids": True}
    )
    assert r.status_code == 200
    body = r.json()
    prompt = list(b"hello")
    want = expected_token_ids(prompt, 7)
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == _text(want) and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == want
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_token_id_prompt_default_max_tokens_and_seed(client):
    prompt = [5, 6, 7]
    body = client.post("/v1/completions", json={"prompt": prompt, "seed": 11, "temperature": 0.5}).json()
    assert body["choices"][0]["text"] == _text(expected_token_ids(prompt, 16, seed=11))  # default max_tokens 16
    assert "token_ids" not in body["choices"][0]
    one = client.post("/v1/completions", json={"prompt": [prompt], "max_tokens": 3}).json()  # batch of one
    assert one["choices"][0]["text"] == _text(expected_token_ids(prompt, 3))


def test_stream_matches_non_stream_and_usage(client):
    body = {"prompt": "abc", "max_tokens": 9, "return_token_ids": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = stream_chunks(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in token_chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == full["text"]
    assert [t for c in token_chunks for t in c["choices"][0]["token_ids"]] == full["token_ids"]
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == list(b"abc")
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    plain = stream_chunks(client, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert all("usage" not in c and "token_ids" not in c["choices"][0] for c in plain)


def test_chat_full_and_stream(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    prompt = list(b"system: be brief\nuser: hi\nassistant:")  # the built-in chat template (helpers.ByteTokenizer)
    want = _text(expected_token_ids(prompt, 6))
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 6}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert body["usage"]["prompt_tokens"] == len(prompt)
    chunks = stream_chunks(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 6})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_is_rest_of_context(client):
    messages = [{"role": "user", "content": "x"}]
    prompt_len = len(b"user: x\nassistant:")
    body = client.post("/v1/chat/completions", json={"messages": messages}).json()
    assert body["usage"]["completion_tokens"] == min(128 - prompt_len, 64)  # max-tokens-limit 64


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_not_echoed(client, stream):
    prompt = list(b"p")
    out = _text(expected_token_ids(prompt, 20))
    stop = out[5:7]  # a two-character stop string inside the output
    want = out[: out.index(stop)]
    body = {"prompt": "p", "max_tokens": 20, "stop": [stop, "zzzz"]}
    if stream:
        chunks = stream_chunks(client, "/v1/completions", body)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) == (want, "stop")


def test_stop_token_ids(client):
    prompt = [1, 2]
    want = expected_token_ids(prompt, 10)
    body = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 10, "stop_token_ids": [want[3]], "return_token_ids": True},
    ).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["token_ids"] == want[: want.index(want[3]) + 1]


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 128
    assert client.get("/health").status_code == 200


def _assert_error(r: httpx.Response, status: int, param: str | None = None, needle: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "x" * 130}, "prompt", "maximum context length is 128"),
        ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 60}, "max_tokens", "exceed"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens", "limit of 64"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n", "less than or equal to 128"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "only best_of == n (1)"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 2}, "min_tokens", "only 0"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed", "64-bit"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "greater than or equal"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias.1", "valid number"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
        ("/v1/completions", {"prompt": 5}, "prompt", "valid"),
        ("/v1/completions", {"prompt": ""}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": []}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt.1", "must not be empty"),
        ("/v1/completions", {"prompt": [[1], [-1]]}, "prompt.1", ">= 0"),
        ("/v1/completions", {"prompt": [1, -2]}, "prompt", ">= 0"),
        ("/v1/completions", {"prompt": [1, 999]}, None, "token ids must be in"),  # the engine's ValueError
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
        ("/v1/completions", {}, "prompt", "Field required"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role", "'system'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "valid string",
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ("/v1/completions", {"prompt": "x", "tools": []}, "tools", "/v1/chat/completions"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than"),
        ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs", "valid boolean"),
    ],
)
def test_bad_requests_are_400(client, path, body, param, needle):  # param None: the error's param is not checked
    _assert_error(client.post(path, json=body), 400, param, needle)


def test_unknown_model_404_and_malformed_json_400(client):
    err = _assert_error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    bad = client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    _assert_error(bad, 400, needle="not valid JSON")
    _assert_error(client.get("/v1/nothing"), 404)
    _assert_error(client.get("/v1/completions"), 405)


def test_body_limit_413(client):
    r = client.post("/v1/completions", json={"prompt": "x" * (1 << 20)})
    assert _assert_error(r, 413)["code"] == "request_too_large"


def test_concurrent_streams_continuous_batching(server, client):
    """32 concurrent streaming requests (capacity 8) all complete with the right tokens; requests join and leave
    the running batch between steps, spread over both DP ranks."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int]:
        body = {"prompt": f"req{i}", "max_tokens": 20 + i % 7, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text, i

    async def run() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    before = server.engine.num_steps
    for text, i in asyncio.run(run()):
        assert text == _text(expected_token_ids(list(f"req{i}".encode()), 20 + i % 7))
    assert server.engine.max_running == 8  # both ranks full at some step
    assert server.engine.num_steps - before < sum(20 + i % 7 for i in range(32))  # batched, not one by one


def _wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_metrics_names_and_counts(server, client):
    before = _metric_values(client.get("/metrics").text)
    n_req, prompt_tokens, out_tokens = 0, 0, 0
    for i, max_tokens in enumerate((2, 5, 8)):
        body = client.post("/v1/completions", json={"prompt": "m" * (i + 1), "max_tokens": max_tokens}).json()
        n_req += 1
        prompt_tokens += body["usage"]["prompt_tokens"]
        out_tokens += body["usage"]["completion_tokens"]
    after = _metric_values(client.get("/metrics").text)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    p = "deep_ep_npu:"
    assert delta(p + 'request_success_total{finished_reason="length",model_name="tiny"}') == n_req
    assert delta(p + 'prompt_tokens_total{model_name="tiny"}') == prompt_tokens
    assert delta(p + 'generation_tokens_total{model_name="tiny"}') == out_tokens
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f'{p}{hist}_count{{model_name="tiny"}}') == n_req
    assert delta(p + 'inter_token_latency_seconds_count{model_name="tiny"}') == out_tokens - n_req
    assert delta(p + 'token_step_seconds_count{model_name="tiny"}') == out_tokens
    for name in ("num_requests_running", "num_requests_waiting"):
        assert after[f'{p}{name}{{model_name="tiny"}}'] == 0
    for hist in ("moe_dispatch_latency_seconds", "moe_combine_latency_seconds", "engine_step_seconds"):
        assert delta(f'{p}{hist}_count{{model_name="tiny"}}') > 0


def _metric_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
