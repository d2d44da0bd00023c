"""Property-based fuzz of the HTTP API (hypothesis, real uvicorn): malformed JSON, wrong types, huge / negative /
non-finite numbers, huge prompts and invalid UTF-8 get a 4xx in OpenAI's error shape, never a 5xx; unknown fields
and any in-range mix of the sampling and log-probability fields are served; the server stays healthy and correct.
Hostile sampling values also go to the real EP runtime, where a bad value that reached a worker would kill the
engine."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.api import create_app
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.config import build_config
from tests.support.serving import FakeEngine, UvicornThread, error_of, expected_token_ids
from tests.support.tiny_moe import real_server

PATHS = ["/v1/completions", "/v1/chat/completions"]
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)
not_int = (
    st.text(max_size=5)
    | st.floats().filter(lambda f: not f.is_integer() if math.isfinite(f) else True)
    | (st.booleans() | st.lists(st.integers(), min_size=1, max_size=3) | st.dictionaries(st.text(max_size=3), scalars))
)
not_float = (
    st.text(max_size=5)
    | st.booleans()
    | st.lists(st.floats(), max_size=3)
    | st.dictionaries(st.text(max_size=3), scalars)
)
not_bool = st.text(max_size=5) | st.integers() | st.floats() | st.lists(st.booleans(), max_size=3)
not_str = st.integers() | st.floats() | st.booleans() | st.lists(st.integers(), min_size=1, max_size=3)
WRONG = {  # field -> values of a type the field does not accept (no coercion: "5" is not an int)
    "max_tokens": not_int,
    "top_k": not_int,
    "seed": not_int,
    "n": not_int,
    "temperature": not_float,
    "top_p": not_float,
    "stream": not_bool,
    "ignore_eos": not_bool,
    "return_token_ids": not_bool,
    "model": not_str,
    "user": not_str,
    "stop": st.integers() | st.lists(st.integers(), min_size=1, max_size=3) | st.dictionaries(st.text(), scalars),
    "stop_token_ids": st.text(max_size=5) | st.lists(st.text(max_size=3) | st.floats(), min_size=1, max_size=3),
    "stream_options": not_str | st.just({"include_usage": "yes"}),
    "presence_penalty": not_float,
    "frequency_penalty": not_float,
    "repetition_penalty": not_float,
    "min_p": not_float,
    "prompt_logprobs": not_int,
    "min_tokens": not_int,
    "logit_bias": not_str | st.dictionaries(st.integers(0, 300).map(str), not_float, min_size=1, max_size=3),
}
WRONG_BY_PATH = {  # fields of one endpoint
    "/v1/completions": {"logprobs": not_int, "echo": not_bool, "best_of": not_int, "suffix": not_str},
    "/v1/chat/completions": {"logprobs": not_bool, "top_logprobs": not_int, "max_completion_tokens": not_int},
}
REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
BASE = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(num_ranks=2, max_num_seqs=4, max_model_len=128, step_time=0.0005)
    config = build_config({"max-tokens-limit": 64, "max-request-bytes": 1 << 20})
    with UvicornThread(create_app(config, engine)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.client = c
        yield srv
        assert c.get("/health").status_code == 200  # still healthy after everything
        body = c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 5, "return_token_ids": True}).json()
        assert body["choices"][0]["token_ids"] == expected_token_ids([3, 4], 5)  # and still correct


def _check(r: httpx.Response, allow_ok: bool = True) -> None:
    """A 4xx in OpenAI's shape, or (when the input happened to be valid) a 200; never a 5xx."""
    if allow_ok and r.status_code == 200:
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error_of(r, r.status_code)


def _post_raw(c: httpx.Client, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    return c.post(path, content=content, headers={"content-type": content_type})


@FUZZ
@given(path=st.sampled_from(PATHS), body=json_values)
def test_arbitrary_json(server, path: str, body: object) -> None:
    _check(_post_raw(server.client, path, json.dumps(body).encode()))  # NaN / Infinity as Python writes them


@FUZZ
@given(path=st.sampled_from(PATHS), data=st.data())
def test_wrong_types_are_400_naming_the_field(server, path: str, data: st.DataObject) -> None:
    wrong = {**WRONG, **WRONG_BY_PATH[path]}
    field = data.draw(st.sampled_from(sorted(wrong)))
    value = data.draw(wrong[field])
    r = _post_raw(server.client, path, json.dumps({**BASE[path], field: value}).encode())
    err = error_of(r, 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field, (field, value, err)


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    field=st.sampled_from(
        [
            "max_tokens",
            "top_k",
            "seed",
            "n",
            "temperature",
            "top_p",
            "max_completion_tokens",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
            "logprobs",
            "top_logprobs",
            "prompt_logprobs",
            "best_of",
        ]
    ),
    value=st.integers(-(2**100), 2**100) | st.floats() | st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1]),
)
def test_huge_negative_and_non_finite_numbers(server, path: str, field: str, value: float) -> None:
    if field == "max_completion_tokens" and path == "/v1/completions":
        field = "max_tokens"
    _check(_post_raw(server.client, path, json.dumps({**BASE[path], field: value}).encode()))


@FUZZ
@given(path=st.sampled_from(PATHS), name=st.text(min_size=1, max_size=10), value=json_values)
def test_unknown_fields_are_ignored(server, path: str, name: str, value: object) -> None:
    """vLLM's behaviour: a field the server does not know is ignored (and logged), the request is served."""
    if name in REQUESTS[path].model_fields:
        return
    r = _post_raw(server.client, path, json.dumps({**BASE[path], name: value}).encode())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


sampling = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4),
        "temperature": st.floats(0, 3) | st.none(),
        "top_p": st.floats(0.01, 1),
        "min_p": st.floats(0, 1),
        "top_k": st.integers(-1, 300),
        "seed": st.integers(-(2**63), 2**64 - 1) | st.none(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 10),
        "stream": st.booleans(),
        "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-200, 200), max_size=3),
        "prompt_logprobs": st.integers(0, 20) | st.none(),
        "return_token_ids": st.booleans(),
    },
)
per_path = {
    "/v1/completions": st.fixed_dictionaries(
        {},
        optional={
            "logprobs": st.integers(0, 20) | st.none(),
            "echo": st.booleans(),
            "prompt": st.sampled_from(["hi", [1, 2], ["a", "bc"], [[3], [4, 5]]]),
        },
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {}, optional={"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
    ),
}


@settings(FUZZ, max_examples=60)
@given(path=st.sampled_from(PATHS), data=st.data())
def test_valid_sampling_fields_are_served(server, path: str, data: st.DataObject) -> None:
    """Any in-range combination of the sampling and log-probability fields is served: n choices per prompt, the
    log-probabilities in the endpoint's shape, one per token."""
    body = {**BASE[path], **data.draw(sampling), **data.draw(per_path[path])}
    if path == PATHS[1] and body.get("top_logprobs") and not body.get("logprobs"):
        body["logprobs"] = True
    r = _post_raw(server.client, path, json.dumps(body).encode())
    assert r.status_code == 200, (body, r.text[:300])
    n = body.get("n", 1)
    num_prompts = (
        len(body["prompt"])
        if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], (str, list))
        else 1
    )
    if body.get("stream"):
        chunks = [json.loads(e[6:]) for e in r.text.strip().split("\n\n") if e != "data: [DONE]"]
        assert {c["choices"][0]["index"] for c in chunks} == set(range(n * num_prompts))
        return
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(n * num_prompts))
    for c in choices:
        lp = c["logprobs"]
        if path == PATHS[0] and body.get("logprobs") is not None:
            echoed = len(c["text"]) - 2 if body.get("echo") else 0  # byte tokens: one character each (ASCII)
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == echoed + 2
        elif path == PATHS[1] and body.get("logprobs"):
            assert len(lp["content"]) == 2
            assert all(len(t["top_logprobs"]) == body.get("top_logprobs", 0) for t in lp["content"])
        else:
            assert lp is None


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    raw=st.binary(max_size=64),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_raw_bytes(server, path: str, raw: bytes, content_type: str) -> None:
    _check(_post_raw(server.client, path, raw, content_type), allow_ok=False)


@FUZZ
@given(path=st.sampled_from(PATHS), junk=st.binary(min_size=1, max_size=8).filter(lambda b: not _utf8(b)))
def test_invalid_utf8_in_strings(server, path: str, junk: bytes) -> None:
    field = b'"prompt"' if path == PATHS[0] else b'"messages": [{"role": "user", "content"'
    tail = b"}" if path == PATHS[0] else b"}]}"
    _check(_post_raw(server.client, path, b"{" + field + b': "' + junk + b'"' + tail), allow_ok=False)


surrogates = st.characters(categories=["Cs"])  # one, at the end of the text: never part of a pair


@FUZZ
@given(
    path=st.sampled_from(PATHS), text=st.text(max_size=5), bad=surrogates, field=st.sampled_from(["", "stop", "user"])
)
def test_lone_surrogates(server, path: str, text: str, bad: str, field: str) -> None:
    """JSON can escape a lone surrogate (``"\\ud800"``), UTF-8 cannot encode it: the prompt or message gets a 400,
    other string fields are served or refused, never a 5xx."""
    body = dict(BASE[path])
    if field:
        body[field] = text + bad
    elif path == PATHS[0]:
        body["prompt"] = text + bad
    else:
        body["messages"] = [{"role": "user", "content": text + bad}]
    r = _post_raw(server.client, path, json.dumps(body).encode())  # ensure_ascii: escaped as \udXXX
    _check(r, allow_ok=bool(field))
    if not field:
        assert error_of(r, 400)["param"] == ("prompt" if path == PATHS[0] else "messages")


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_huge_prompts(server) -> None:
    c = server.client
    cases = [
        ("/v1/completions", {"prompt": "x" * 600_000}),
        ("/v1/completions", {"prompt": list(range(100)) * 1000}),
        ("/v1/completions", {"prompt": [2**70]}),
        ("/v1/completions", {"prompt": [[1] * 50_000]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 20_000}),
        ("/v1/completions", {"prompt": "x" * 2_000_000}),
    ]  # the last is over the body limit
    for path, body in cases:
        r = c.post(path, json=body)
        _check(r, allow_ok=False)
    assert c.get("/health").status_code == 200


HOSTILE = [
    {"seed": 2**64},
    {"seed": -(2**63) - 1},
    {"seed": 2**64 - 1},
    {"seed": -1},
    {"temperature": 1e-320},
    {"temperature": 1e308},
    {"temperature": "Infinity"},
    {"top_k": 2**70},
    {"top_k": 0},
    {"top_p": 1e-300},
    {"stop_token_ids": [2**70]},
    {"stop": ["\x00", "\udfff"]},
    {"max_tokens": 2**63},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
    {"logit_bias": {"255": 1e300}},
    {"logit_bias": {"999999": 5}},
    {"presence_penalty": 2, "frequency_penalty": -2, "min_p": 1},
    {"logprobs": 20, "echo": True},
    {"n": 3, "seed": 2**64 - 1},
]


def test_hostile_sampling_values_on_the_real_runtime() -> None:
    """Each hostile value is refused (400) or served (200); none reaches a worker in a form that crashes it."""
    with real_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for extra in HOSTILE:
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.7, **extra})
            body = body.replace('"Infinity"', "Infinity")
            r = _post_raw(c, "/v1/completions", body.encode())
            _check(r)
            if r.status_code == 200:
                choices = r.json()["choices"]
                full = r.json()["usage"]["completion_tokens"] == 3 * len(choices)
                assert full or any(c["finish_reason"] == "stop" for c in choices)
            assert c.get("/health").status_code == 200, f"{extra} took the engine down"
