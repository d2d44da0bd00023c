"""SIGTERM while requests run (``python -m server``, 2 EP workers): the server stops accepting, a short request in
flight finishes in full, a long one is failed visibly (an error event, or a response cut before its end, which the
client sees as an incomplete body), the process exits 0 within uvicorn's grace period and no process is left."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx

from tests.support.launch import assert_all_exit, descendants, output, start_healthy
from tests.support.serving import stream_completion
from tests.support.tiny_moe import TINY_MODEL

GRACE_S = 5  # uvicorn's timeout_graceful_shutdown in server/api/serve.py


def test_sigterm_finishes_short_requests_and_fails_long_ones_visibly() -> None:
    def command(port: int, _: int) -> list[list[str]]:
        return [
            [
                sys.executable,
                "-m",
                "server",
                "--port",
                str(port),
                "--ep-size",
                "2",
                "--backend",
                "reference",
                "--random-model",
                json.dumps(TINY_MODEL),
                "--max-model-len",
                "4096",
                "--log-level",
                "warning",
            ]
        ]

    (proc,), url = start_healthy(command)
    try:
        workers = descendants(proc.pid)
        assert len(workers) >= 2
        common = {"prompt": [1, 2, 3], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        short, long = {}, {}
        threads = [
            threading.Thread(target=stream_completion, args=(url, {**common, "max_tokens": n}, out))
            for n, out in ((60, short), (4000, long))
        ]
        for t in threads:
            t.start()
        for out in (short, long):
            assert out.setdefault("first", threading.Event()).wait(30)
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        time.sleep(0.3)
        try:  # no new work once shutdown began: refused, or a clean error status
            r = httpx.post(url + "/v1/completions", json={**common, "max_tokens": 1}, timeout=5)
            assert r.status_code >= 500, r.text
        except httpx.HTTPError:
            pass
        code = proc.wait(timeout=GRACE_S + 20)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(timeout=10)
    assert code == 0, output(proc)
    assert took < GRACE_S + 10, f"shutdown took {took:.1f}s"
    assert (short["tokens"], short["finish"], short["done"]) == (60, "length", True), short
    # the long one did not finish: it must not look finished (no finish_reason, no clean [DONE] without an error)
    assert long["tokens"] < 4000 and long["finish"] is None, long
    assert long["broken"] is not None or (long["error"] is not None and long["done"]), long
    assert_all_exit(workers)
