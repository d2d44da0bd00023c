"""Soak: 500 requests of mixed lengths (streaming and not, greedy and sampled, some with stop tokens) against the real
2-worker EP runtime, 10% of the clients disconnecting early. Every completed request has exactly ``max_tokens``
tokens or ends on one of its stop tokens, nothing fails but the intended disconnects, the engine drains, and the
workers' resident memory stays flat (printed: RSS before / after). Plus a burst far over capacity: 503 with
``Retry-After`` right away, bounded admission, the admitted requests complete."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from server.api import create_app
from server.config import build_config
from tests.support.serving import FakeEngine, UvicornThread
from tests.support.tiny_moe import real_server

NUM_REQUESTS = 500
CONCURRENCY = 48
DISCONNECT_SHARE = 0.1
RSS_GROWTH_LIMIT = 16 << 20  # bytes per worker over the 500 requests (after a warm-up of the same mix)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _request(rng: random.Random) -> dict:
    body = {
        "prompt": [rng.randrange(1, 256) for _ in range(rng.randint(1, 48))],
        "max_tokens": rng.randint(1, 12),
        "temperature": rng.choice([0.0, 0.8]),
        "return_token_ids": True,
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["stop_token_ids"] = rng.sample(range(256), 8)
    if rng.random() < DISCONNECT_SHARE:
        body["disconnect"] = True
    return body


async def _one(c: httpx.AsyncClient, body: dict) -> tuple[str, list[int] | None, str | None]:
    """``("ok", token_ids, finish_reason)`` or ``("disconnected", None, None)``; anything else raises."""
    disconnect = body.pop("disconnect", False)
    if not body["stream"]:
        if disconnect:  # the whole request is sent, then the connection closes before any answer (on any machine)
            data = json.dumps(body).encode()
            _, writer = await asyncio.open_connection(c.base_url.host, c.base_url.port)
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {c.base_url.host}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(data)}\r\n\r\n"
            )
            writer.write(head.encode() + data)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            return "disconnected", None, None
        r = await c.post("/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == len(choice["token_ids"])
        return "ok", choice["token_ids"], choice["finish_reason"]
    token_ids, finish, done = [], None, False
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            token_ids += event["choices"][0]["token_ids"]
            finish = event["choices"][0]["finish_reason"] or finish
            if disconnect:
                return "disconnected", None, None  # leaving the block closes the connection mid-stream
    assert done
    return "ok", token_ids, finish


async def _run(url: str, bodies: list[dict]) -> list[tuple[dict, tuple]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    # a fresh connection per request: a pooled one that the server's keep-alive timeout closes just as a request
    # reuses it is a client-side ReadError (seen under load), not what this test is about
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:

        async def guarded(body: dict) -> tuple[dict, tuple]:
            async with sem:
                return dict(body), await _one(c, body)

        return await asyncio.gather(*(guarded(b) for b in bodies))


def test_soak_500_requests_with_disconnects() -> None:
    rng = random.Random(0)
    with real_server(**{"max-num-seqs": 16, "max-queue-len": 512, "max-model-len": 128}) as srv:
        async_engine = srv.server.config.app.state.serving.engine
        asyncio.run(_run(srv.url, [_request(rng) for _ in range(60)]))  # warm-up: caches, allocator pools
        before = [_rss(pid) for pid in srv.worker_pids]
        start = time.monotonic()
        results = asyncio.run(_run(srv.url, [_request(rng) for _ in range(NUM_REQUESTS)]))
        took = time.monotonic() - start
        deadline = time.monotonic() + 10
        while async_engine.num_unfinished or srv.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine did not drain"
            time.sleep(0.02)
        after = [_rss(pid) for pid in srv.worker_pids]
        assert httpx.get(srv.url + "/health").status_code == 200
    counts = {"ok": 0, "disconnected": 0}
    for body, (outcome, token_ids, finish) in results:
        counts[outcome] += 1
        if outcome == "disconnected":
            assert body.get("disconnect")
            continue
        if finish == "length":
            assert len(token_ids) == body["max_tokens"], (body, token_ids)
        else:
            assert finish == "stop" and token_ids[-1] in body.get("stop_token_ids", ()), (body, token_ids, finish)
            assert len(token_ids) <= body["max_tokens"]
    num_disconnects = counts["disconnected"]  # every disconnecting client disconnects (before its answer)
    assert sum(1 for body, _ in results if body.get("disconnect")) == num_disconnects
    assert 0.05 * NUM_REQUESTS < num_disconnects < 0.15 * NUM_REQUESTS
    print(
        f"\nsoak: {NUM_REQUESTS} requests in {took:.1f}s, {num_disconnects} disconnects; worker RSS MiB before "
        f"{[round(b / 2**20, 1) for b in before]} after {[round(a / 2**20, 1) for a in after]}"
    )
    for b, a in zip(before, after, strict=True):
        assert a - b < RSS_GROWTH_LIMIT, f"worker RSS grew by {(a - b) / 2**20:.1f} MiB"


def test_burst_over_capacity_is_503_with_retry_after_and_bounded() -> None:
    """200 simultaneous requests at capacity 8 + queue 8: the rest get 503 + Retry-After at once (not queued without
    bound), every admitted one completes in full, and the engine never holds more than 16 unfinished requests."""
    engine = FakeEngine(num_ranks=2, max_num_seqs=4, max_model_len=128, step_time=0.002)
    config = build_config({"ep-size": 2, "max-queue-len": 8})
    app = create_app(config, engine)
    async_engine = app.state.serving.engine
    peak = 0

    async def sample_peak() -> None:  # admitted-and-unfinished requests, sampled while the burst runs
        nonlocal peak
        while True:
            peak = max(peak, async_engine.num_unfinished)
            await asyncio.sleep(0.0005)

    async def burst(url: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            sampler = asyncio.ensure_future(sample_peak())
            try:
                return await asyncio.gather(
                    *(c.post("/v1/completions", json={"prompt": f"b{i}", "max_tokens": 20}) for i in range(200))
                )
            finally:
                sampler.cancel()

    with UvicornThread(app) as srv:
        responses = asyncio.run(burst(srv.url))
        assert httpx.get(srv.url + "/health").status_code == 200
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == 200 and len(ok) >= 16 and refused
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "engine_overloaded"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 20
    assert peak <= 16 and engine.max_running <= 8
