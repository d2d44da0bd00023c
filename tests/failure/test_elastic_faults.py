"""Faults injected at chosen points of a step (:mod:`tests.support.faults.sitecustomize`) into ``python -m server
--elastic`` at EP 4, with a placement that keeps a replica of every expert on two ranks (ranks 0 and 3 hold experts 0-3,
ranks 1 and 2 experts 4-7): a rank lost mid-step (its peers meet the failure in different collectives, or after
finishing theirs), a second rank lost while the survivors regroup after the first, a rank lost while EPLB moves expert
weights. While every expert keeps a live replica, every token served is the full model's (an independent single-process
oracle, every expert local) or the request fails visibly: the streams of the lost ranks end with an error naming
them, every other stream and every new request gets exactly the oracle's tokens, and ``experts_lost`` stays 0."""

from __future__ import annotations

import json
import os
import re
import sys
import threading

import httpx
import pytest
import torch

from deep_ep_npu.eplb import placement_json
from tests.support.launch import FAULTS, ROOT, output, start_healthy, stop
from tests.support.serving import greedy, stream_completion
from tests.support.tiny_moe import MODEL, PROMPT, oracle_greedy

pytestmark = pytest.mark.slow
STREAM = greedy([1, 2, 3], 120)


def _serve_with_faults(tmp_path, faults: str, *extra: str) -> tuple[list[dict], str, list[list[int]], str]:  # noqa: ANN001
    """Four streams (stream i on worker i: least-loaded placement) on a server whose ranks meet ``faults`` (at step
    40 or later: every stream has started by then, also on a loaded machine); then ``/metrics``, two new requests'
    token ids and the server's log."""
    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 0, 1, 2, 3]] * MODEL["num_hidden_layers"])
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_json(rows, 4)))
    args = [
        "--ep-size",
        "4",
        "--random-model",
        json.dumps(MODEL),
        "--elastic",
        "--step-timeout-s",
        "6",
        "--expert-placement",
        str(path),
        "--num-redundant-experts",
        "8",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
        *extra,
    ]
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{FAULTS}", "DEEP_EP_NPU_TEST_FAULTS": faults}
    procs, url = start_healthy(lambda port, _: [[sys.executable, "-m", "server", "--port", str(port), *args]], env=env)
    try:
        outs = [{"first": threading.Event()} for _ in range(4)]
        threads = [threading.Thread(target=stream_completion, args=(url, STREAM, out)) for out in outs]
        for t, out in zip(threads, outs, strict=True):
            t.start()
            assert out["first"].wait(60), output(procs[0])
        for t in threads:
            t.join(timeout=120)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            metrics = c.get("/metrics").text
            body = greedy(PROMPT, 8)
            new = [c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2)]
    finally:
        stop(procs)
    return outs, metrics, new, output(procs[0])


def _check(outs: list[dict], metrics: str, new: list[list[int]], log: str, lost: set[int]) -> None:
    for i, out in enumerate(outs):
        if i in lost:
            assert out["error"] is not None and f"EP worker {i} was lost" in out["error"]["message"], (out, log)
        else:
            assert (out["finish"], out["error"], out["token_ids"]) == (
                "length",
                None,
                oracle_greedy(STREAM["prompt"], STREAM["max_tokens"]),
            ), (i, out, log)
    assert new == [oracle_greedy(PROMPT, 8)] * 2, log
    assert re.search(rf"ep_ranks_lost\{{[^}}]*\}} {len(lost)}\.0", metrics), metrics
    assert re.search(r"experts_lost\{[^}]*\} 0\.0", metrics), metrics


@pytest.mark.parametrize(
    ("faults", "lost"),
    [
        ("1:dispatch:81", {1}),  # rank 1 gone at a dispatch: its peers fail there, or at the next collective
        ("2:combine:81", {2}),  # rank 2 gone after its dispatch: its peers meet the failure in the combine
        ("1:dispatch:81,3:regroup:1", {1, 3}),  # and rank 3 gone while the survivors regroup
    ],
    ids=["mid-dispatch", "mid-combine", "second-loss-while-regrouping"],
)
def test_a_step_across_a_loss_is_run_again_on_the_survivors(tmp_path, faults: str, lost: set[int]) -> None:  # noqa: ANN001
    _check(*_serve_with_faults(tmp_path, faults), lost)


def test_a_rank_lost_while_eplb_moves_weights(tmp_path) -> None:  # noqa: ANN001
    """EPLB rebalances every 40 steps; rank 1 dies between the two MoE layers' weight moves of the first one: no rank
    switches to the half-moved placement (the survivors keep the one every rank ran), nothing changes tokens."""
    outs, metrics, new, log = _serve_with_faults(
        tmp_path, "1:move:2", "--eplb", "--eplb-interval", "40", "--eplb-window", "40"
    )
    _check(outs, metrics, new, log, {1})
