"""A dead or hung EP worker under the real runtime (2 spawned workers, gloo) on real uvicorn: ``/health`` turns 503
within a few seconds, in-flight requests end with a clear error (never a hang, never a silently short answer), new
requests get 503, and no worker process is left behind.

"Dead" is SIGKILL (a crash the worker cannot report); "hung" is SIGSTOP (alive but never answering), which only the
step timeout (``step-timeout-s``) or the between-steps ping can catch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.support.serving import UvicornThread, error_of, wait_until
from tests.support.tiny_moe import STEP_TIMEOUT_S, real_server

LONG = {"prompt": [1, 2, 3], "max_tokens": 500, "temperature": 0, "ignore_eos": True}


def assert_workers_gone(engine: object, timeout: float = 10.0) -> None:
    procs = engine.workers.procs
    wait_until(lambda: not any(p.is_alive() for p in procs), timeout, "worker processes left behind", poll=0.05)


async def _stream_until_failure(srv: UvicornThread, sig: int, rank: int) -> tuple[list[dict], dict, float, dict]:
    """A streaming and a non-streaming request are in flight; after the stream's first chunk, ``sig`` hits worker
    ``rank``. Returns the stream's chunks, its error event, the seconds from the signal to the stream's end, and
    the non-streaming request's error."""
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        full = asyncio.ensure_future(c.post("/v1/completions", json=LONG))
        chunks, error, killed_at = [], None, None
        async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                chunks.append(event)
                if killed_at is None:
                    os.kill(srv.worker_pids[rank], sig)
                    killed_at = time.monotonic()
        elapsed = time.monotonic() - killed_at
        full_error = error_of(await full, 503)
    assert error is not None, "the stream ended without an error event"
    return chunks, error, elapsed, full_error


@pytest.mark.parametrize(
    ("sig", "needle", "limit_s"),
    [
        (signal.SIGKILL, "worker 1 exited", 3.0),  # noticed at once (the process sentinel)
        (signal.SIGSTOP, f"did not answer within {STEP_TIMEOUT_S:g}s", STEP_TIMEOUT_S + 3.0),  # by the step timeout
    ],
)
def test_worker_failure_mid_request(sig: int, needle: str, limit_s: float) -> None:
    with real_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        chunks, error, elapsed, full_error = asyncio.run(_stream_until_failure(srv, sig, rank=1))
        assert elapsed < limit_s, f"the stream took {elapsed:.1f}s to fail"
        for err in (error, full_error):
            assert err["code"] == "engine_unavailable" and needle in err["message"], err
        # never silently truncated: no chunk claims the request finished, and it got fewer tokens than asked
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks)
        assert error_of(c.get("/health"), 503)["code"] == "engine_unavailable"
        assert error_of(c.post("/v1/completions", json=LONG), 503)["code"] == "engine_unavailable"
        assert_workers_gone(srv.engine)  # the survivor, blocked in a collective with the dead one, too


@pytest.mark.parametrize(
    ("sig", "needle"),
    [
        (signal.SIGKILL, "worker 0 exited with code -9"),
        (signal.SIGSTOP, f"workers [0] did not answer within {STEP_TIMEOUT_S:g}s"),  # the ping names the hung one
    ],
)
def test_idle_worker_failure_turns_health_503(sig: int, needle: str) -> None:
    """No request runs: the engine thread's health poll (about 1 s) plus the ping timeout finds the worker."""
    with real_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        ok = c.post("/v1/completions", json={**LONG, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        os.kill(srv.worker_pids[0], sig)
        start = time.monotonic()
        while c.get("/health").status_code == 200:
            assert time.monotonic() - start < STEP_TIMEOUT_S + 3.0, "/health still 200"
            time.sleep(0.05)
        assert error_of(c.get("/health"), 503)["code"] == "engine_unavailable"
        err = error_of(c.post("/v1/completions", json=LONG), 503)
        assert err["code"] == "engine_unavailable" and needle in err["message"], err
        assert_workers_gone(srv.engine)
