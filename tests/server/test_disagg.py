"""Prefill/decode disaggregation through the router (one prefill instance at EP 1, one decode instance at EP 2,
KV moved by Mooncake over loopback TCP) against one colocated server on the same random checkpoint: greedy outputs
token-identical, the decode instance computes no prompt token and receives exactly the prompts' KV bytes, and every
KV block is back at the end."""

from __future__ import annotations

import asyncio
import json
import queue
import random
import threading

import httpx
import pytest

from server.api import create_app
from server.api.serve import build_engine
from server.config import build_config
from server.disagg.fetch import Fetch
from server.disagg.layout import KVLayout
from server.router import Pool, create_router_app
from tests.support.disagg import KV_BYTES_PER_TOKEN, RANDOM_MODEL, metric
from tests.support.serving import UvicornThread, wait_until

BASE = {
    "random-model": RANDOM_MODEL,
    "max-num-seqs": 8,
    "max-model-len": 1100,
    "kv-cache-memory": "32M",
    "log-level": "warning",
    "backend": "reference",
}
N_REQUESTS = 16


@pytest.fixture(scope="module")
def deployment():
    configs = {
        "colocated": build_config({**BASE, "ep-size": 2}),
        "prefill": build_config(
            {**BASE, "ep-size": 1, "disaggregation-mode": "prefill", "disaggregation-bootstrap-port": 0}
        ),
        "decode": build_config({**BASE, "ep-size": 2, "disaggregation-mode": "decode"}),
    }
    engines = {}
    try:
        for name, config in configs.items():
            engines[name] = build_engine(config)
    except BaseException:
        for engine in engines.values():
            engine.shutdown()
        raise
    servers = {name: UvicornThread(create_app(configs[name], engines[name])) for name in configs}
    with servers["colocated"] as c, servers["prefill"] as p, servers["decode"] as d:
        router = create_router_app(Pool("prefill", [p.url], "round-robin"), Pool("decode", [d.url], "least-loaded"))
        with UvicornThread(router) as r:
            yield {"colocated": c.url, "prefill": p.url, "decode": d.url, "router": r.url, "engines": engines}


def _requests() -> list[dict]:
    """16 greedy requests: completions and chat, streamed and not, prompts of 1..1000 tokens."""
    rng = random.Random(7)
    out = []
    for i in range(N_REQUESTS):
        n = [1000, 999, 17, 16, 1][i] if i < 5 else rng.randint(2, 1000)
        common = {
            "temperature": 0,
            "max_tokens": rng.randint(2, 24),
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": i % 2 == 1,
            "stream_options": {"include_usage": True} if i % 2 else None,
        }
        if i % 4 < 2:
            out.append(("/v1/completions", {**common, "prompt": [rng.randrange(1, 250) for _ in range(n)]}))
        else:
            text = "".join(rng.choice("abcdefghij klmnop") for _ in range(n // 2))
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}))
    return out


async def _call(client: httpx.AsyncClient, url: str, path: str, body: dict) -> tuple[list[int], int]:
    """The output token ids and the prompt's token count of one request."""
    if not body["stream"]:
        r = await client.post(url + path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens"]
    ids, prompt_tokens = [], None
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    ids += event["choices"][0].get("token_ids") or []
                if event.get("usage"):
                    prompt_tokens = event["usage"]["prompt_tokens"]
    assert prompt_tokens is not None
    return ids, prompt_tokens


def _run_all(url: str, requests: list) -> list[tuple[list[int], int]]:
    async def main() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_call(client, url, path, body) for path, body in requests))

    return asyncio.run(main())


def test_router_outputs_equal_colocated_and_decode_computes_no_prompt(deployment):
    requests = _requests()
    want = _run_all(deployment["colocated"], requests)  # one by one would be the same: greedy, batch-invariant
    got = _run_all(deployment["router"], requests)
    for (path, body), (ids, n_prompt), (ref_ids, ref_prompt) in zip(requests, got, want, strict=True):
        assert n_prompt == ref_prompt
        assert ids == ref_ids, (path, n_prompt)
        assert len(ids) == body["max_tokens"]
    d, p = deployment["decode"], deployment["prefill"]
    prompt_tokens = sum(n for _, n in want)
    generated = sum(len(ids) for ids, _ in want)
    # every request's prompt KV came through the transfer engine, exactly the prompts' bytes, nothing computed here
    assert metric(d, "kv_transfer_tokens_total", direction="recv") == prompt_tokens
    assert metric(d, "kv_transfer_bytes_total", direction="recv") == prompt_tokens * KV_BYTES_PER_TOKEN
    assert metric(d, "kv_transfer_seconds_count", direction="recv") == N_REQUESTS
    assert metric(d, "prompt_tokens_total") == prompt_tokens
    # decode steps carry decodes only: the first token came from the prefill instance, each later one is one token
    assert metric(d, "iteration_tokens_total_sum") == generated - N_REQUESTS
    assert metric(d, "generation_tokens_total") == generated
    wait_until(
        lambda: metric(p, "kv_transfer_tokens_total", direction="send") == prompt_tokens,
        10,
        "the prefill side did not count what it sent",
    )
    assert metric(p, "kv_transfer_bytes_total", direction="send") == prompt_tokens * KV_BYTES_PER_TOKEN
    assert metric(p, "iteration_tokens_total_sum") <= prompt_tokens  # prompts only (prefix-cache hits skipped)
    for url in (p, d):  # every block is back
        wait_until(lambda url=url: metric(url, "kv_cache_usage_perc") == 0.0, 10, f"KV blocks leaked at {url}")
    assert deployment["engines"]["prefill"].num_parked == 0


def test_prefix_cache_hits_transfer_only_the_rest(deployment):
    d = deployment["decode"]
    prompt = [(7 * i) % 240 + 3 for i in range(100)]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    want = httpx.post(deployment["colocated"] + "/v1/completions", json=body, timeout=60).json()
    before = metric(d, "kv_transfer_tokens_total", direction="recv")
    for _ in range(2):
        r = httpx.post(deployment["router"] + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    # the first copy moves all 100 tokens; the second finds 6 full blocks (96 tokens) cached on its decode rank
    # (requests go to the least-loaded rank, the longest cached prefix first) and moves only the last 4
    assert metric(d, "kv_transfer_tokens_total", direction="recv") - before == 100 + 4


def test_bootstrap_fields_are_required_and_checked(deployment):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(deployment["decode"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_host", r.text
    r = httpx.post(deployment["colocated"] + "/v1/completions", json={**body, "bootstrap_room": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
    assert httpx.get(deployment["router"] + "/v1/models", timeout=30).json()["data"][0]["id"] == "random-qwen3-moe"
    assert httpx.get(deployment["router"] + "/health", timeout=30).status_code == 200


def test_layout_mismatch_is_refused_at_the_handshake_naming_both_sides(deployment):
    info = httpx.get(deployment["prefill"] + "/disaggregation", timeout=30).json()
    theirs = deployment["engines"]["decode"].layout
    mine = KVLayout(theirs.model, theirs.dtype, 32, theirs.num_layers, theirs.token_bytes)  # block size 32
    answers: queue.SimpleQueue = queue.SimpleQueue()
    Fetch(
        "r",
        info["bootstrap_host"],
        info["bootstrap_port"],
        "room-x",
        mine,
        "the test's decode side",
        [1, 2],
        5.0,
        answers,
        threading.Event(),
    )
    _, error = answers.get(timeout=10)
    assert isinstance(error, str)
    assert f"prefill instance 127.0.0.1:{info['bootstrap_port']} has model random-qwen3-moe" in error
    assert "block-size 16" in error and "the test's decode side has" in error and "block-size 32" in error


def test_structured_output_through_the_router(deployment):
    """The prefill instance samples the first token under the grammar, the decode instance goes on from it: every
    output validates, and greedy ones equal the colocated server's."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
    }
    bodies = [
        {"prompt": f"record {seed}:", "max_tokens": 60, "temperature": temperature, "seed": seed, "guided_json": schema}
        for seed in range(4)
        for temperature in (0.0, 1.0)
    ]

    def run(url: str) -> list[dict]:
        async def main() -> list:
            async with httpx.AsyncClient(timeout=120) as client:
                rs = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
            return [r.json()["choices"][0] for r in rs]

        return asyncio.run(main())

    got, want = run(deployment["router"]), run(deployment["colocated"])
    for body, choice, ref in zip(bodies, got, want, strict=True):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)
        if body["temperature"] == 0:
            assert choice["text"] == ref["text"]
