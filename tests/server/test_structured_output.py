"""Structured output and tool calling over the real EP runtime (2 spawned workers) on real uvicorn, on the default
random model (byte-level vocabulary) and on a small HF checkpoint with a byte-level BPE ``tokenizer.json``.

Oracles: ``jsonschema`` validates every JSON output against its schema, ``re.fullmatch`` every regex output, the
choice list every choice output; tool calls must name a declared tool and their arguments validate against its
``parameters``. All (seed, temperature) cases run concurrently against one server start per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.support.checkpoints import make_checkpoint
from tests.support.serving import error_of
from tests.support.tiny_moe import real_server
from tests.support.tokenizers import CHATML, make_tokenizer

SEEDS = range(20)
TEMPERATURES = (0.0, 0.7, 1.0)
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "kind": {"enum": ["x", "y"]},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
            },
        },
        "required": ["ok", "kind", "point"],
    },
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "minItems": 1, "maxItems": 4},
]
REGEX = r"[a-f]{2,4}-\d{1,3}(\.[xyz])?"
CHOICES = ["yes", "no", "maybe later", "ünïcode"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[0]}},
    {"type": "function", "function": {"name": "set_flag", "parameters": SCHEMAS[1]}},
]
MESSAGES = [{"role": "user", "content": "hello world, how are you?"}]
OPTIONS = {
    "step-timeout-s": 60,
    "max-model-len": 2048,
    "max-num-seqs": 16,
    "enable-auto-tool-choice": True,
    "tool-call-parser": "hermes",
}


@contextlib.contextmanager
def _hf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    path = str(tmp_path_factory.mktemp("structured"))
    make_checkpoint("qwen3_moe", path, vocab_size=320, eos_token_id=1)  # </s> of the tokenizer below
    make_tokenizer(path, CHATML)
    with real_server(model=path, **{"served-model-name": "tiny", **OPTIONS}) as srv:
        yield srv


@pytest.fixture(scope="module", params=["random", "hf"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if request.param == "random":
        with real_server(**{"random-model": {}, **OPTIONS}) as srv:
            yield srv
    else:
        with _hf_server(tmp_path_factory) as srv:
            yield srv


async def _post(c: httpx.AsyncClient, path: str, body: dict) -> tuple[str, list, str | None, dict]:
    """``(text, tool_calls, finish_reason, message or first choice)`` of one request, streamed or not; a streamed
    chat's tool calls are accumulated from their deltas as the OpenAI client does."""
    r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        if chat:
            return (
                choice["message"]["content"] or "",
                choice["message"].get("tool_calls") or [],
                choice["finish_reason"],
                choice["message"],
            )
        return choice["text"], [], choice["finish_reason"], choice
    text, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for choice in event["choices"]:
            delta = choice.get("delta", {})
            text += (delta.get("content") or "") if chat else choice["text"]
            for call in delta.get("tool_calls") or []:
                acc = calls.setdefault(call["index"], {"id": None, "function": {"name": "", "arguments": ""}})
                acc["id"] = call.get("id") or acc["id"]
                acc["function"]["name"] += call.get("function", {}).get("name") or ""
                acc["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return text, [calls[i] for i in sorted(calls)], finish, {}


def _cases() -> list[tuple[str, str, dict]]:
    """``(kind, path, body)`` for every seed, temperature and form."""
    cases = []
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            base = {"seed": seed, "temperature": temperature, "max_tokens": 120}
            schema = SCHEMAS[seed % len(SCHEMAS)]
            fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
            for stream in (False, True):
                extra = {**base, "stream": stream}
                cases.append(("json", "/v1/chat/completions", {**extra, "messages": MESSAGES, "response_format": fmt}))
                cases.append(
                    (
                        "json",
                        "/v1/completions",
                        {
                            **extra,
                            "prompt": "hello",
                            **({"response_format": fmt} if seed % 2 else {"structured_outputs": {"json": schema}}),
                        },
                    )
                )
                tool_choice = (
                    "required"
                    if stream == (seed % 2 == 0)
                    else {"type": "function", "function": {"name": TOOLS[seed % 2]["function"]["name"]}}
                )
                cases.append(
                    (
                        "tools",
                        "/v1/chat/completions",
                        {
                            **extra,
                            "messages": MESSAGES,
                            "tools": TOOLS,
                            "tool_choice": tool_choice,
                            "parallel_tool_calls": False,
                        },
                    )
                )
            cases.append(("regex", "/v1/completions", {**base, "prompt": "id:", "guided_regex": REGEX}))
            cases.append(
                (
                    "choice",
                    "/v1/chat/completions",
                    {**base, "messages": MESSAGES, "structured_outputs": {"choice": CHOICES}},
                )
            )
    return cases


def _check(kind: str, body: dict, text: str, calls: list, finish: str | None) -> None:
    if kind == "tools":
        assert finish == "tool_calls" and calls, (body, text, finish)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        named = body["tool_choice"]
        for call in calls:
            assert call["id"] and call["function"]["name"] in schemas
            if isinstance(named, dict):
                assert call["function"]["name"] == named["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        return
    assert finish == "stop", (body, text, finish)
    if kind == "json":
        fmt = body.get("response_format")
        schema = fmt["json_schema"]["schema"] if fmt else body["structured_outputs"]["json"]
        jsonschema.validate(json.loads(text), schema)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def test_every_constrained_output_is_valid(server) -> None:
    cases = _cases()

    async def run() -> list:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:

            async def one(path: str, body: dict) -> tuple:
                async with limit:
                    return await _post(c, path, body)

            return await asyncio.gather(*(one(path, body) for _, path, body in cases))

    results = asyncio.run(run())
    for (kind, _, body), (text, calls, finish, _) in zip(cases, results, strict=True):
        _check(kind, body, text, calls, finish)
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r'structured_output_requests_total\{kind="regex",model_name="[^"]+"\} 60.0', metrics)
    assert re.search(r"grammar_compile_seconds_count\{[^}]*\} [1-9]", metrics)


GRAMMAR = 'root ::= "(" item ("," item)? ")" | "none"\nitem ::= [a-c] [a-c]? [0-9]?'
GRAMMAR_RE = r"\([a-c][a-c]?[0-9]?(,[a-c][a-c]?[0-9]?)?\)|none"


def test_json_object_and_ebnf_grammar_outputs_are_valid(server) -> None:
    bodies = []
    for seed in range(5):
        for temperature in TEMPERATURES:
            base = {"seed": seed, "temperature": temperature, "max_tokens": 120}
            bodies.append(("/v1/completions", {**base, "prompt": "x", "structured_outputs": {"grammar": GRAMMAR}}))
            bodies.append(("/v1/completions", {**base, "prompt": "x", "response_format": {"type": "json_object"}}))
            bodies.append(
                ("/v1/chat/completions", {**base, "messages": MESSAGES, "structured_outputs": {"json_object": True}})
            )

    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            return await asyncio.gather(*(_post(c, path, body) for path, body in bodies))

    for (_, body), (text, _, finish, _) in zip(bodies, asyncio.run(run()), strict=True):
        if "grammar" in body.get("structured_outputs", {}):
            assert finish == "stop" and re.fullmatch(GRAMMAR_RE, text), text
        elif finish == "stop":  # any JSON object: a long one may not finish within max_tokens
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length" and text.startswith("{"), text


def test_unconstrained_greedy_is_unchanged_by_constrained_neighbours(server) -> None:
    plain = [
        {"prompt": f"prompt {i} says", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for i in range(6)
    ]
    constrained = [
        {"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": i, "structured_outputs": {"json": SCHEMAS[0]}}
        for i in range(6)
    ]

    async def run(bodies: list[dict]) -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        return [r.json()["choices"][0] for r in rs]

    alone = asyncio.run(run(plain))
    mixed = asyncio.run(run([b for pair in zip(plain, constrained, strict=True) for b in pair]))[::2]
    assert [c["token_ids"] for c in alone] == [c["token_ids"] for c in mixed]


def test_a_slow_schema_does_not_stall_other_requests(server) -> None:
    """A schema that takes a second or more to compile (compiled in a thread): an unconstrained request sent after
    it finishes first."""
    fields = {
        f"f{i}_{id(server)}": {
            "type": "object",
            "properties": {f"k{j}": {"type": ["string", "integer", "null"], "maxLength": 40} for j in range(4)},
        }
        for i in range(16)
    }
    slow = {"prompt": "x", "max_tokens": 4, "guided_json": {"type": "object", "properties": fields}}
    fast = {"prompt": "y", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            start = asyncio.get_running_loop().time()

            async def timed(body: dict, delay: float) -> float:
                await asyncio.sleep(delay)
                assert (await c.post("/v1/completions", json=body)).status_code == 200
                return asyncio.get_running_loop().time() - start

            return await asyncio.gather(timed(slow, 0.0), timed(fast, 0.05))

    slow_done, fast_done = asyncio.run(run())
    assert fast_done < slow_done


def test_a_schema_longer_than_max_tokens_ends_with_length(server) -> None:
    long = {"type": "array", "items": {"enum": ["abcdef"]}, "minItems": 50}
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": "x", "max_tokens": 20, "guided_json": long, "temperature": 0},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].startswith('["abcdef", "')


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools.2.function.name"),
    ],
)
def test_bad_structured_input_is_a_400_naming_the_field(server, body: dict, param: str) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=60
    )
    assert error_of(r, 400)["param"] == param


def test_tools_on_completions_are_refused(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60)
    assert error_of(r, 400)["param"] == "tools"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=7)


def test_openai_client_parse_and_tool_loop(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for seed in range(3):
        done = client.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=Person, seed=seed, max_tokens=80
        )
        assert isinstance(done.choices[0].message.parsed, Person)
        with client.chat.completions.stream(
            model=model, messages=MESSAGES, response_format=Person, seed=seed, max_tokens=80
        ) as stream:
            assert isinstance(stream.get_final_completion().choices[0].message.parsed, Person)
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    for streamed in (False, True):
        messages: list = [{"role": "user", "content": "weather in Paris?"}]
        kwargs = {
            "model": model,
            "tools": [tool],
            "tool_choice": "required",
            "max_tokens": 80,
            "seed": 1,
            "parallel_tool_calls": False,
        }
        if streamed:
            with client.chat.completions.stream(messages=messages, **kwargs) as stream:
                first = stream.get_final_completion()
        else:
            first = client.chat.completions.parse(messages=messages, **kwargs)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, GetWeather)
        messages += [
            message.model_dump(exclude_none=True, exclude={"parsed"}),
            {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
        ]
        answer = client.chat.completions.create(  # "auto" (the default with tools): hermes finds no call here
            model=model, messages=messages, tools=[tool], max_tokens=8, stream=streamed
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in answer) if streamed else answer.choices[0].message.content
        )
        assert isinstance(text, str)
