"""Faults of a disaggregated deployment (two prefill instances and one decode instance as ``python -m server``
processes, the router in this process): a prefill instance killed while its requests' KV is being prepared or
moved fails exactly those requests, with an error naming it, in bounded time, and the router goes on serving on
the other one; a decode instance killed mid-stream ends its streams with an error naming it and the prefill side
frees every block it held. Nothing leaks: KV usage back to 0 and no bootstrap connection left open."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server.router import Pool, create_router_app
from tests.support.disagg import TIMEOUT_S, Instance, body, established, metric, serving, stream
from tests.support.serving import UvicornThread, wait_until


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    started = [
        Instance(tmp, "prefill_a", "--disaggregation-mode", "prefill"),
        Instance(tmp, "prefill_b", "--disaggregation-mode", "prefill"),
        Instance(tmp, "decode", "--disaggregation-mode", "decode"),
    ]
    with serving(started):
        yield started


def _run(url: str, bodies: list[dict], after=None) -> list[dict]:
    outs: list[dict] = [{} for _ in bodies]
    threads = [threading.Thread(target=stream, args=(url, b, o)) for b, o in zip(bodies, outs, strict=True)]
    for t in threads:
        t.start()
    if after is not None:
        after()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a request did not end in bounded time"
    return outs


def test_prefill_and_decode_deaths(instances):
    prefill_a, prefill_b, decode = instances
    pools = Pool("prefill", [prefill_a.url, prefill_b.url], "round-robin"), Pool("decode", [decode.url], "round-robin")
    with UvicornThread(create_router_app(*pools)) as router:
        # a prefill instance dies while its requests' prompts are computed or their KV moved
        bodies = [body(i, 1000, 4) for i in range(6)]  # round-robin: 3 go to prefill A, 3 to prefill B
        outs = _run(router.url, bodies, after=lambda: (time.sleep(0.3), prefill_a.kill()))
        names_a = (prefill_a.url, f"127.0.0.1:{prefill_a.bootstrap_port}")
        failed = [out for out in outs if out["error"] is not None]
        for out in outs:
            assert out["seconds"] < 2 * TIMEOUT_S, out  # bounded
            if out["error"] is None:
                assert out["tokens"] == 4, out
            else:  # only prefill A's, naming it (B's all succeed; A's unless A finished before it died)
                assert "prefill instance" in out["error"] and any(name in out["error"] for name in names_a), out
        assert 1 <= len(failed) <= 3, outs
        # the router serves on: every request now goes to prefill B
        outs = _run(router.url, [body(10 + i, 200, 3) for i in range(4)])
        assert all(out["error"] is None and out["tokens"] == 3 for out in outs), outs
        for url in (decode.url, prefill_b.url):
            wait_until(lambda url=url: metric(url, "kv_cache_usage_perc") == 0.0, 2 * TIMEOUT_S, f"leak at {url}")
        wait_until(lambda: established(prefill_b.bootstrap_port) == 0, 5, "a bootstrap connection is left open")

        # the decode instance dies mid-stream: its streams end with an error naming it, prefill B frees its blocks
        before = metric(decode.url, "generation_tokens_total")

        def kill_decode_mid_stream() -> None:  # once the long streams are decoding (the short ones may be too)
            wait_until(lambda: metric(decode.url, "generation_tokens_total") > before + 4, 30, "no token came")
            decode.kill()

        bodies = [body(20 + i, 600, 400) for i in range(2)] + [body(30 + i, 1000, 4) for i in range(2)]
        outs = _run(router.url, bodies, after=kill_decode_mid_stream)
        assert all(out["error"] is not None and decode.url in out["error"] for out in outs[:2]), outs
        assert all(out["tokens"] < 400 for out in outs[:2]), outs
        wait_until(lambda: metric(prefill_b.url, "kv_cache_usage_perc") == 0.0, 2 * TIMEOUT_S, "prefill B leaked")
        wait_until(lambda: established(prefill_b.bootstrap_port) == 0, 5, "a bootstrap connection is left open")
        assert httpx.get(router.url + "/health", timeout=10).status_code == 503  # no decode instance is up
