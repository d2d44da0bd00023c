"""An elastic decode instance loses an EP rank mid-stream (prefill at EP 1 and decode at EP 2 ``--elastic`` as
``python -m server`` processes, the router in this process; rank 1 of the decode instance SIGKILLs itself at its
41st combine, :mod:`tests.support.faults.sitecustomize`). Every expert has a replica on each rank
(``--num-redundant-experts 8``), so none is lost: the streams of rank 1 end with an error naming it, every other stream
and every new request gets exactly the full model's tokens (an independent single-process oracle), and both sides free
every KV block."""

from __future__ import annotations

import os
import re
import threading

import httpx
import pytest

from server.router import Pool, create_router_app
from tests.support.disagg import TIMEOUT_S, Instance, metric, serving, stream
from tests.support.launch import FAULTS, ROOT
from tests.support.serving import UvicornThread, greedy, wait_until
from tests.support.tiny_moe import MODEL, PROMPT, oracle_greedy

pytestmark = pytest.mark.slow
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
MAX_TOKENS = 60


@pytest.fixture
def instances(tmp_path):
    common = ("--max-model-len", "256", "--kv-cache-memory", "8M", "--max-num-seqs", "4")
    faults = {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{FAULTS}",
        "DEEP_EP_NPU_TEST_FAULTS": "1:combine:41",
    }
    started = [
        Instance(tmp_path, "prefill", "--disaggregation-mode", "prefill", *common, model=MODEL),
        Instance(
            tmp_path,
            "decode",
            "--disaggregation-mode",
            "decode",
            *common,
            "--ep-size",
            "2",
            "--elastic",
            "--step-timeout-s",
            "6",
            "--num-redundant-experts",
            "8",
            model=MODEL,
            env=faults,
        ),
    ]
    with serving(started):
        yield started


def _greedy(prompt: list[int]) -> dict:
    return greedy(prompt, MAX_TOKENS)


def test_a_decode_rank_lost_mid_stream_changes_no_token(instances):
    prefill, decode = instances
    pools = Pool("prefill", [prefill.url], "round-robin"), Pool("decode", [decode.url], "round-robin")
    with UvicornThread(create_router_app(*pools)) as router:
        outs: list[dict] = [{} for _ in PROMPTS]
        pairs = zip(PROMPTS, outs, strict=True)
        threads = [threading.Thread(target=stream, args=(router.url, _greedy(p), o)) for p, o in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a stream did not end in bounded time"
        log = decode.log_path.read_text()
        assert "EP rank 1" in log or "worker 1" in log, log[-3000:]  # the fault fired: rank 1 was lost
        failed = [o for o in outs if o["error"] is not None]
        assert 0 < len(failed) < len(PROMPTS), (outs, log[-3000:])  # (rank 1's streams; rank 0's go on)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            if out["error"] is not None:
                assert "worker 1" in out["error"] and out["tokens"] < MAX_TOKENS, (out, log[-3000:])
            else:
                assert out["token_ids"] == oracle_greedy(prompt, MAX_TOKENS), (prompt, out, log[-3000:])
        with httpx.Client(timeout=60, trust_env=False) as client:
            for _ in range(2):  # served by rank 0 alone now, every expert still there
                r = client.post(router.url + "/v1/completions", json={**_greedy(PROMPT), "max_tokens": 8})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == oracle_greedy(PROMPT, 8)
            text = client.get(decode.url + "/metrics").text
        assert re.search(r"ep_ranks_lost\{[^}]*\} 1\.0", text), text
        assert re.search(r"experts_lost\{[^}]*\} 0\.0", text), text
        for url in (prefill.url, decode.url):
            wait_until(lambda url=url: metric(url, "kv_cache_usage_perc") == 0.0, 2 * TIMEOUT_S, f"leak at {url}")
