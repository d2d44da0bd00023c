"""A host lost while serving across simulated hosts (issue 28; :mod:`tests.support.hosts`, helpers
:mod:`tests.support.hosts_serving`): two hosts x 2 torchrun ranks, host 1 killed or cut off mid-stream, with and
without ``--elastic``, with and without replicas of every expert on host 0. Nothing hangs; nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

import httpx
import pytest
import torch

from tests.support import hosts
from tests.support.hosts_serving import (
    PROMPT,
    ep4_args,
    node_log,
    serving_on_two_hosts,
    stop_after_loss,
    stream,
)
from tests.support.launch import alive, descendants, proc_environ

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(why := hosts.unavailable()), reason=why or "-")]


SHORT = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _stream_then(url: str, path: str, act: Callable[[], None]) -> tuple[list[float], str, list[float]]:
    """Stream a completion from ``url`` and ``act()`` once its third token arrived: the tokens' arrival times, how the
    stream ended, and when ``act`` ran (empty if the stream ended first)."""
    acted: list[float] = []

    def at_third(i: int) -> None:
        if i == 2:
            act()
            acted.append(time.monotonic())

    times, error = stream(url, os.path.basename(path), at_third)
    return times, error, acted


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "not-elastic"])
def test_host_killed_mid_stream(hosts_checkpoint, elastic: bool):
    """Host 1 (ranks 2, 3) is killed while rank 0 streams. ``--elastic``: the stream finishes, its longest gap
    within 2 x the step timeout, and new requests are served by host 0; else the stream ends with the reason and
    new requests get 503 naming the lost ranks. Either way nothing hangs and nothing is left behind."""
    path, _ = hosts_checkpoint
    step_timeout = 4.0
    args = ep4_args("--model", path, "--step-timeout-s", str(step_timeout), *(["--elastic"] if elastic else []))
    with serving_on_two_hosts(args) as (sim, nodes, url):
        times, error, killed = _stream_then(url, path, lambda: sim.kill_host(1))
        assert killed, "the stream ended before host 1 was killed"
        http = httpx.Client(trust_env=False, timeout=60)
        try:
            after = http.post(url + "/v1/completions", json=SHORT)
            health = http.get(url + "/health")
        except httpx.HTTPError as err:
            raise AssertionError(f"host 0 stopped serving ({err}):\n{node_log(nodes[0])[-2500:]}") from err
        if elastic:
            assert error == "finished", error
            assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2 * step_timeout
            assert after.status_code == 200 and health.status_code == 200, after.text
        else:
            assert "rank" in error and times[-1] - killed[0] < 2 * step_timeout, (error, times[-1] - killed[0])
            assert after.status_code == 503 and "rank 2" in after.text, after.text
        stop_after_loss(nodes[0])


def test_host_cut_off_then_back(hosts_checkpoint):
    """``--elastic``: host 1's link is cut while rank 0 streams: the stream finishes (longest gap within 2 x the step
    timeout) and host 0 serves on; once the link is back, host 1's ranks are refused (told they were lost, they
    leave) and host 0 still serves alone."""
    path, _ = hosts_checkpoint
    step_timeout = 4.0
    args = ep4_args("--model", path, "--step-timeout-s", str(step_timeout), "--elastic")
    with serving_on_two_hosts(args) as (sim, nodes, url):
        host1 = [p for p in descendants(nodes[1].pid) if proc_environ(p).get("RANK") is not None]
        times, error, cut = _stream_then(url, path, lambda: sim.cut(1))
        assert error == "finished" and cut, error
        gap = max(b - a for a, b in zip(times, times[1:], strict=False))
        assert gap < 2 * step_timeout, (gap, node_log(nodes[0])[-3000:])
        http = httpx.Client(trust_env=False, timeout=60)
        assert http.post(url + "/v1/completions", json=SHORT).status_code == 200
        sim.uncut(1)
        # a rank that was inside a gloo wait when the link came back leaves once that wait gives up: within the
        # process groups' timeout (EngineConfig.dist_timeout_s, 120 s), then it reads its verdict
        deadline = time.monotonic() + 120 + 30
        while [p for p in host1 if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in host1 if alive(p)], "host 1's ranks stayed:\n" + node_log(nodes[1])
        assert "leaves the job" in node_log(nodes[1]), node_log(nodes[1])
        assert http.post(url + "/v1/completions", json=SHORT).status_code == 200
        lost = next(ln for ln in http.get(url + "/metrics").text.splitlines() if "ep_ranks_lost{" in ln)
        assert lost.endswith("} 2.0"), (lost, node_log(nodes[0]))
        stop_after_loss(nodes[0])


def test_lost_host_replicas_keep_every_expert(tmp_path):
    """``--elastic`` with a placement that gives each host a copy of every expert (ranks 0, 1 and 2, 3 each hold
    experts 0-3 and 4-7): host 1 killed mid-stream, the stream finishes, and new requests' greedy tokens equal the
    model with every expert (single-process oracle); no expert is lost."""
    from deep_ep_npu.eplb import placement_json
    from tests.support.serving import greedy
    from tests.support.tiny_moe import MODEL, oracle_greedy

    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]] * MODEL["num_hidden_layers"])
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_json(rows, 4)))
    placed = ("--expert-placement", str(path), "--num-redundant-experts", "8")
    args = ep4_args("--random-model", json.dumps(MODEL), "--step-timeout-s", "4", "--elastic", *placed)
    with serving_on_two_hosts(args) as (sim, nodes, url):
        times, ended = stream(url, "random-qwen3-moe", lambda i: i == 2 and sim.kill_host(1))
        assert ended == "finished", ended
        http = httpx.Client(trust_env=False, timeout=60)
        body = greedy([7, 3, 9, 1], 8)
        got = http.post(url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
        metrics = http.get(url + "/metrics").text
        assert got == oracle_greedy([7, 3, 9, 1], 8), got
        assert re.search(r"ep_ranks_lost\{[^}]*\} 2\.0", metrics) and re.search(r"experts_lost\{[^}]*\} 0\.0", metrics)
        stop_after_loss(nodes[0])
