"""The server over the real EP runtime (2 spawned workers, gloo) on real uvicorn, serving a tiny checkpoint that
transformers built and saved. Golden: greedy ``return_token_ids`` equal transformers' ``generate``."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from server.api import create_app
from server.api.serve import build_engine
from server.config import build_config
from tests.support.checkpoints import load_hf, make_checkpoint
from tests.support.serving import UvicornThread

STEPS = 12
PROMPTS = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([1, 6, 19, 40])]


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen3")))
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None  # run all STEPS, like ignore_eos
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt) :].tolist())
    return path, out


@pytest.fixture(scope="module")
def served(golden):
    config = build_config(
        {
            "model": golden[0],
            "ep-size": 2,
            "max-num-seqs": 8,
            "max-model-len": 128,
            "served-model-name": "tiny-qwen3",
            "log-level": "warning",
        }
    )
    engine = build_engine(config)
    with UvicornThread(create_app(config, engine)) as srv:
        srv.engine = engine
        srv.state = srv.server.config.app.state.serving
        yield srv
    assert not engine.workers.is_alive()  # the app's lifespan shut the workers down


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def _greedy(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny-qwen3",
        "prompt": prompt,
        "max_tokens": STEPS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def _stream(client: httpx.Client, body: dict) -> list[dict]:
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[6:]) for e in events[:-2]]


def test_golden_greedy_tokens_match_transformers(client, golden):
    for prompt, want in zip(PROMPTS, golden[1], strict=True):
        choice = client.post("/v1/completions", json=_greedy(prompt)).json()["choices"][0]
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == want
        assert choice["finish_reason"] == "length"


def test_streaming_gives_the_same_tokens(client, golden):
    for prompt, want in zip(PROMPTS[:2], golden[1][:2], strict=True):
        *chunks, usage = _stream(client, _greedy(prompt))
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == STEPS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_complete_with_right_tokens(served, golden):
    """32 streams on 16 slots (2 workers x 8): requests queue, join running batches and all finish correctly."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, list[int], int]:
        body = {**_greedy(PROMPTS[i % 4]), "max_tokens": STEPS - i % 3, "stream": True}
        ids: list[int] = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return i, ids, STEPS - i % 3

    async def run() -> list:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    for i, ids, n in asyncio.run(run()):
        assert ids == golden[1][i % 4][:n]


def test_cancel_mid_stream_frees_capacity(served, client):
    async_engine = served.state.engine
    body = {"prompt": PROMPTS[1], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept alive: a collected iterator closes the stream, which cancels the request
        next(line for line in lines if line.startswith("data: {"))
        assert async_engine.num_unfinished == 1
    deadline = time.monotonic() + 10
    while async_engine.num_unfinished or served.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.01)
    aborted = _metric(client, 'deep_ep_npu:request_success_total{finished_reason="abort",model_name="tiny-qwen3"}')
    assert aborted == 0  # cancelled by the client: not counted as a finished request
    assert client.post("/v1/completions", json=_greedy(PROMPTS[0])).json()["choices"][0]["token_ids"]


def test_health_and_ep_metrics(client):
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-qwen3"
    for name in ("moe_dispatch_latency_seconds_count", "moe_combine_latency_seconds_count"):
        assert _metric(client, f'deep_ep_npu:{name}{{model_name="tiny-qwen3"}}') > 0
    assert _metric(client, 'deep_ep_npu:num_requests_running{model_name="tiny-qwen3"}') == 0


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")
