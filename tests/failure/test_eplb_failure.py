"""Replicas survive a lost rank (--elastic with --expert-placement): EP 4, an 8-expert model with 8 redundant
experts placed so that every expert has two replicas on different workers. Killing worker 1 mid-generation keeps
the server answering; the survivors drop it from every map and send its experts' tokens to the other replicas, so
a new request's greedy tokens equal the model with every expert (an independent single-process oracle: LocalComm,
all experts local), no expert is lost (metric 0), and the streams on the survivors finish with the oracle's tokens
across the step in which the rank was lost."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import torch

from deep_ep_npu.eplb import placement_json
from tests.support.serving import greedy, stream_completion
from tests.support.tiny_moe import MODEL, PROMPT, oracle_greedy, real_server

LONG = greedy([1, 2, 3], 300)


def _kill_worker_1(options: dict) -> tuple[list[dict], str, list[list[int]]]:
    """Four streams (one per worker), SIGKILL worker 1 after their first tokens; the streams, /metrics and three
    new requests' token ids. Only worker 1 is lost: the survivors may notice the loss in different collectives (or
    one may finish its step first), but the driver alone decides who is lost."""
    with real_server(**options) as srv:
        outs = [{"first": threading.Event()} for _ in range(4)]
        threads = []
        for out in outs:  # least-loaded placement: request i on worker i
            threads.append(threading.Thread(target=stream_completion, args=(srv.url, LONG, out)))
            threads[-1].start()
            assert out["first"].wait(60)
        os.kill(srv.worker_pids[1], signal.SIGKILL)
        for t in threads:
            t.join(timeout=90)
        assert sorted(srv.engine.workers.lost) == [1], srv.engine.workers.lost
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            metrics = c.get("/metrics").text
            body = greedy(PROMPT, 8)
            token_ids = [c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(3)]
    return outs, metrics, token_ids


def test_replicas_keep_the_model_after_a_lost_rank(tmp_path) -> None:  # noqa: ANN001
    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 0, 1, 2, 3]] * 2)  # rank r and r + 2 hold copies
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_json(rows, 4)))
    # a killed worker is found at once (its connections close); a survivor slowed by a loaded machine makes the
    # step run again at worst (never a lost survivor)
    options = {
        "elastic": True,
        "step-timeout-s": 6.0,
        "ep-size": 4,
        "random-model": MODEL,
        "expert-placement": str(path),
        "num-redundant-experts": 8,
    }
    outs, metrics, token_ids = _kill_worker_1(options)
    assert outs[1]["error"] is not None and "EP worker 1 was lost" in outs[1]["error"]["message"]
    for i in (0, 2, 3):
        assert (outs[i]["tokens"], outs[i]["finish"], outs[i]["error"]) == (300, "length", None), outs[i]
    assert 'deep_ep_npu:ep_ranks_lost{model_name="random-qwen3-moe"} 1.0' in metrics
    assert 'deep_ep_npu:experts_lost{model_name="random-qwen3-moe"} 0.0' in metrics
    balance = re.findall(r'expert_load_balancedness\{layer="(\d)",model_name="[^"]+"\} ([0-9.]+)', metrics)
    assert [layer for layer, _ in balance] == ["0", "1"] and all(0 < float(v) <= 1 for _, v in balance)
    load = re.findall(r'expert_load_total\{model_name="[^"]+",rank="(\d)"\} ([0-9.]+)', metrics)
    assert sorted(rank for rank, _ in load) == ["0", "1", "2", "3"] and all(float(v) > 0 for _, v in load)
    assert token_ids == [oracle_greedy(PROMPT, 8)] * 3
    # the survivors' streams, across the step in which worker 1 died (its MoE layers re-run on the replicas)
    assert [outs[i]["token_ids"] for i in (0, 2, 3)] == [oracle_greedy(LONG["prompt"], 300)] * 3
