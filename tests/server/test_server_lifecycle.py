"""Cancellation, overload (bounded queue), API key and a dying engine, over real uvicorn and a fake engine."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from server.api import create_app
from server.async_engine import AsyncEngine, EngineDeadError
from server.config import build_config
from server.engine_api import SamplingParams
from tests.support.serving import FakeEngine, UvicornThread, error_of, wait_until


@pytest.fixture
def one_slot():
    """Capacity 1 (one rank, one slot), no waiting queue, 10 ms steps."""
    engine = FakeEngine(num_ranks=1, max_num_seqs=1, max_model_len=256, step_time=0.01)
    config = build_config({"ep-size": 1, "max-queue-len": 0})
    with UvicornThread(create_app(config, engine)) as srv:
        srv.engine = engine
        yield srv


def test_cancel_mid_stream_frees_the_slot(one_slot):
    engine = one_slot.engine
    with httpx.Client(base_url=one_slot.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            request_id = first["id"]
            busy = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})  # the only slot is taken
            err = error_of(busy, 503)
            assert err["code"] == "engine_overloaded" and busy.headers["retry-after"] == "1"
        # leaving the block closes the connection mid-stream
        wait_until(lambda: request_id in engine.finished_aborts)
        assert engine.num_steps < 200  # it did not run to the end
        wait_until(lambda: not engine.running)
        ok = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_disconnect_cancels_non_streaming_request(one_slot):
    engine = one_slot.engine
    with httpx.Client(base_url=one_slot.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200})  # ~2 s of steps
    wait_until(lambda: len(engine.finished_aborts) == 1)  # only an abort lands here, never a completion
    wait_until(lambda: not engine.running)


def test_api_key():
    config = build_config({"api-key": "sekret", "ep-size": 1})
    with UvicornThread(create_app(config, FakeEngine())) as srv, httpx.Client(base_url=srv.url) as c:
        assert error_of(c.get("/v1/models"), 401)["code"] == "invalid_api_key"
        assert c.get("/v1/models").headers["www-authenticate"] == "Bearer"
        error_of(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        error_of(c.get("/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        error_of(c.post("/v1/completions", json={"prompt": "x"}), 401)
        good = {"Authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=good).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key
        assert c.get("/metrics").status_code == 200


def test_engine_failure_is_503_and_unhealthy():
    engine = FakeEngine(step_time=0.001, fail_at_step=3)
    with UvicornThread(create_app(build_config({}), engine)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True})
        assert r.status_code == 200
        events = [e[6:] for e in r.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_unavailable" and "worker 1 died" in err["message"]
        assert error_of(c.get("/health"), 503)["code"] == "engine_unavailable"
        assert error_of(c.post("/v1/completions", json={"prompt": "x"}), 503)["code"] == "engine_unavailable"
    assert engine.shut_down


def test_engine_failure_non_streaming_is_503():
    engine = FakeEngine(step_time=0.001, fail_at_step=2)
    with UvicornThread(create_app(build_config({}), engine)) as srv, httpx.Client(base_url=srv.url) as c:
        assert error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 9}), 503)["code"] == (
            "engine_unavailable"
        )


def test_health_follows_an_idle_engine():
    """A worker dying while no request runs turns /health to 503 within the health poll (about 1 s)."""
    engine = FakeEngine()
    with UvicornThread(create_app(build_config({}), engine)) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/health").status_code == 200
        engine.healthy = False
        wait_until(lambda: c.get("/health").status_code == 503, timeout=5)
        assert error_of(c.post("/v1/completions", json={"prompt": "x"}), 503)["code"] == "engine_unavailable"


class _StepBlocksThenFails(FakeEngine):
    def __init__(self) -> None:
        super().__init__(step_time=0.0)
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self):  # noqa: ANN201
        self.entered.set()
        self.release.wait(10)
        raise RuntimeError("worker 0 died")


def test_requests_queued_during_a_failing_step_get_503_not_a_hang():
    async def scenario() -> None:
        engine = _StepBlocksThenFails()
        async_engine = AsyncEngine(engine, capacity=4, max_queue_len=4)
        async_engine.start()
        params = SamplingParams(max_tokens=2)
        first = await async_engine.add_request("a", [1], params)
        await asyncio.to_thread(engine.entered.wait, 10)
        second = asyncio.ensure_future(async_engine.add_request("b", [1], params))  # queued behind the step
        await asyncio.sleep(0.05)
        engine.release.set()
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            await asyncio.wait_for(second, 10)
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            async for _ in async_engine.stream(first):
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("c", [1], params)
        await async_engine.shutdown()
        assert engine.shut_down

    asyncio.run(scenario())
