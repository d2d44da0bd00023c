"""Serving across simulated hosts (issue 28; :mod:`tests.hosts`): two hosts (network namespaces with their own
address and a private ``/dev/shm``), one ``torchrun --nnodes 2 --nproc-per-node 2`` per host, rendezvous on host 0's
address, the ranks' process groups on the hosts' interface (``--socket-ifname eth0``); rank 0 serves HTTP on host
0's address and this machine asks through the real ``openai`` client. Greedy tokens equal the single-host EP 4
server's (and transformers'). Teardown leaves no process, namespace, link or ``/dev/shm`` file."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
import torch

from tests import hosts
from tests.server.test_models_ckpt import load_hf, make_checkpoint
from tests.server.test_server_launch import (
    ROOT,
    TORCHRUN,
    _assert_all_exit,
    _descendants,
    _environ,
    _stop,
    start_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(why := hosts.unavailable()), reason=why or "-")]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
HTTP_PORT, MASTER_PORT = 8000, 29500  # (each host has its own ports: nothing else listens there)


def _log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()[-6000:]  # type: ignore[attr-defined]


def start_nodes(sim: hosts.SimulatedHosts, per_host: int, server_args: list[str]) -> list[subprocess.Popen]:
    """One torchrun per host (``per_host`` ranks each) running ``python -m server *server_args``; rank 0 on host 0
    serves HTTP at ``sim.addresses[0]:HTTP_PORT``."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    nodes = []
    for h in range(len(sim.names)):
        cmd = [
            TORCHRUN,
            "--nnodes",
            str(len(sim.names)),
            "--node-rank",
            str(h),
            "--nproc-per-node",
            str(per_host),
            "--master-addr",
            sim.addresses[0],
            "--master-port",
            str(MASTER_PORT),
            "-m",
            "server",
            "--host",
            sim.addresses[0],
            "--port",
            str(HTTP_PORT),
            "--socket-ifname",
            "eth0",
            *server_args,
        ]
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
        proc = sim.start(h, cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        proc.log = log  # type: ignore[attr-defined]
        nodes.append(proc)
    return nodes


def wait_healthy(url: str, nodes: list[subprocess.Popen], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in nodes:
            if p.poll() is not None:
                raise RuntimeError(f"a node exited with {p.returncode}:\n" + "\n".join(_log(n) for n in nodes))
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server on the simulated hosts was not healthy in time:\n" + "\n".join(map(_log, nodes)))


def stop_rank0(nodes: list[subprocess.Popen]) -> list[int]:
    """SIGTERM the HTTP rank (global rank 0): it tells the other ranks to stop and every torchrun exits; returns the
    torchruns' exit codes (a node still running after 60 s is killed: code -9)."""
    rank0 = [p for p in _descendants(nodes[0].pid) if _environ(p).get("RANK") == "0"]
    assert len(rank0) == 1, rank0
    os.kill(rank0[0], signal.SIGTERM)
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=60))
        except subprocess.TimeoutExpired:
            node.kill()
            codes.append(node.wait())
    return codes


def stop_after_loss(node: subprocess.Popen) -> None:
    """Stop host 0 once host 1 is gone: SIGTERM the HTTP rank; once host 0's ranks have exited, its torchrun waits
    in its exit barrier for the lost node's (torchrun's own ``exit_barrier_timeout``, 300 s, blocked in the store,
    deaf to SIGTERM): it is killed, having nothing left to stop."""
    ranks = [p for p in _descendants(node.pid) if _environ(p).get("RANK") is not None]
    rank0 = [p for p in ranks if _environ(p).get("RANK") == "0"]
    assert len(rank0) == 1, rank0
    os.kill(rank0[0], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while [p for p in ranks if os.path.exists(f"/proc/{p}")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}")], "host 0's ranks did not exit:\n" + _log(node)
    node.kill()
    node.wait(timeout=30)


def _greedy(url: str, model: str) -> list[int]:
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60, http_client=httpx.Client(trust_env=False)
    )
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(out.choices[0].token_ids)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("ckpt") / "ckpt"))
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    return path, want


def test_torchrun_two_hosts_equals_one_host(checkpoint):
    path, want = checkpoint
    args = ["--model", path, "--ep-size", "4", "--max-model-len", "64", "--log-level", "warning"]
    (one,), one_url = start_healthy(lambda port, _: [[sys.executable, "-m", "server", *args, "--port", str(port)]])
    try:
        single_host = _greedy(one_url, os.path.basename(path))
    finally:
        _stop([one])
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = start_nodes(sim, 2, args)
        url = f"http://{sim.addresses[0]}:{HTTP_PORT}"
        wait_healthy(url, nodes)
        pids = set().union(*(_descendants(n.pid) for n in nodes))
        got = _greedy(url, os.path.basename(path))
        codes = stop_rank0(nodes)
        assert codes == [0, 0], "\n".join(map(_log, nodes))
    finally:
        sim.close()
    assert got == single_host == want
    _assert_all_exit(pids)


def _stream(url: str, model: str, on_chunk) -> tuple[list[float], str]:
    """Stream a long greedy completion through the openai client; ``on_chunk(i)`` after each chunk. The chunks'
    arrival times and how the stream ended: ``"finished"`` (its finish reason ``length``) or the error."""
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60, http_client=httpx.Client(trust_env=False)
    )
    times, ended = [], "no finish reason"
    try:
        stream = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=96, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for i, chunk in enumerate(stream):
            times.append(time.monotonic())
            if chunk.choices and chunk.choices[0].finish_reason == "length":
                ended = "finished"
            on_chunk(i)
    except openai.APIError as err:
        return times, str(err)
    return times, ended


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "not-elastic"])
def test_host_killed_mid_stream(checkpoint, elastic: bool):
    """Host 1 (ranks 2, 3) is killed while rank 0 streams. ``--elastic``: the stream finishes, its longest gap
    within 2 x the step timeout, and new requests are served by host 0; else the stream ends with the reason and
    new requests get 503 naming the lost ranks. Either way nothing hangs and nothing is left behind."""
    path, _ = checkpoint
    step_timeout = 4.0
    args = [
        "--model",
        path,
        "--ep-size",
        "4",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
        "--step-timeout-s",
        str(step_timeout),
        *(["--elastic"] if elastic else []),
    ]
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = start_nodes(sim, 2, args)
        url = f"http://{sim.addresses[0]}:{HTTP_PORT}"
        wait_healthy(url, nodes)
        pids = set().union(*(_descendants(n.pid) for n in nodes))
        killed: list[float] = []

        def kill_at_third(i: int) -> None:
            if i == 2:
                sim.kill_host(1)
                killed.append(time.monotonic())

        times, error = _stream(url, os.path.basename(path), kill_at_third)
        assert killed, "the stream ended before host 1 was killed"
        http = httpx.Client(trust_env=False, timeout=60)
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        try:
            after = http.post(url + "/v1/completions", json=body)
            health = http.get(url + "/health")
        except httpx.HTTPError as err:
            raise AssertionError(f"host 0 stopped serving ({err}):\n{_log(nodes[0])[-2500:]}") from err
        if elastic:
            assert error == "finished", error
            assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2 * step_timeout
            assert after.status_code == 200 and health.status_code == 200, after.text
        else:
            assert "rank" in error and times[-1] - killed[0] < 2 * step_timeout, (error, times[-1] - killed[0])
            assert after.status_code == 503 and "rank 2" in after.text, after.text
        stop_after_loss(nodes[0])
    finally:
        sim.close()
    _assert_all_exit(pids)


def readme_commands(marker: str) -> list[list[str]]:
    """The command lines of the README's bash block after ``marker`` (continuation lines joined, comments dropped)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text[text.index(marker) :].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def test_a3_two_node_commands():
    """README's two-node A3 commands (configs/ascend_a3_2nodes.yaml, the stand-in, small shapes) as written, one per
    simulated host: node 0 answers a completion with the config's API key; SIGTERM to rank 0 stops both nodes."""
    commands = readme_commands("tests/server/test_server_hosts.py::test_a3_two_node_commands")
    assert len(commands) == 2 and all(c[0] == "torchrun" for c in commands), commands
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = []
        for h, cmd in enumerate(commands):
            argv = [TORCHRUN] + [a.replace("<node0>", sim.addresses[0]).replace("<ifname>", "eth0") for a in cmd[1:]]
            log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
            proc = sim.start(h, argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
            proc.log = log  # type: ignore[attr-defined]
            nodes.append(proc)
        url = f"http://{sim.addresses[0]}:8000"  # (the config's port)
        wait_healthy(url, nodes)
        pids = set().union(*(_descendants(n.pid) for n in nodes))
        client = openai.OpenAI(
            base_url=url + "/v1",
            api_key="change-me",
            max_retries=0,
            timeout=60,
            http_client=httpx.Client(trust_env=False),
        )
        out = client.completions.create(
            model="a3-moe", prompt="Hello, Ascend!", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        assert len(out.choices[0].token_ids) == 8  # type: ignore[attr-defined]
        assert stop_rank0(nodes) == [0, 0], "\n".join(map(_log, nodes))
    finally:
        sim.close()
    _assert_all_exit(pids)


def test_host_cut_off_then_back(checkpoint):
    """``--elastic``: host 1's link is cut while rank 0 streams: the stream finishes (longest gap within 2 x the step
    timeout) and host 0 serves on; once the link is back, host 1's ranks are refused (told they were lost, they
    leave) and host 0 still serves alone."""
    path, _ = checkpoint
    step_timeout = 4.0
    args = [
        "--model",
        path,
        "--ep-size",
        "4",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
        "--step-timeout-s",
        str(step_timeout),
        "--elastic",
    ]
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = start_nodes(sim, 2, args)
        url = f"http://{sim.addresses[0]}:{HTTP_PORT}"
        wait_healthy(url, nodes)
        pids = set().union(*(_descendants(n.pid) for n in nodes))
        host1 = [p for p in _descendants(nodes[1].pid) if _environ(p).get("RANK") is not None]
        cut: list[float] = []

        def cut_at_third(i: int) -> None:
            if i == 2:
                sim.cut(1)
                cut.append(time.monotonic())

        times, error = _stream(url, os.path.basename(path), cut_at_third)
        assert error == "finished" and cut, error
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2 * step_timeout
        http = httpx.Client(trust_env=False, timeout=60)
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert http.post(url + "/v1/completions", json=body).status_code == 200
        sim.uncut(1)
        deadline = time.monotonic() + 60
        while [p for p in host1 if os.path.exists(f"/proc/{p}")] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in host1 if os.path.exists(f"/proc/{p}")], "host 1's ranks stayed:\n" + _log(nodes[1])
        assert "leaves the job" in _log(nodes[1]), _log(nodes[1])
        assert http.post(url + "/v1/completions", json=body).status_code == 200
        lost = next(ln for ln in http.get(url + "/metrics").text.splitlines() if "ep_ranks_lost{" in ln)
        assert lost.endswith("} 2.0"), (lost, _log(nodes[0]))
        stop_after_loss(nodes[0])
    finally:
        sim.close()
    _assert_all_exit(pids)


def test_lost_host_replicas_keep_every_expert(tmp_path):
    """``--elastic`` with a placement that gives each host a copy of every expert (ranks 0, 1 and 2, 3 each hold
    experts 0-3 and 4-7): host 1 killed mid-stream, the stream finishes, and new requests' greedy tokens equal the
    model with every expert (single-process oracle); no expert is lost."""
    import json

    from deep_ep_npu.eplb import placement_json
    from tests.server.test_eplb_failure import MODEL, oracle_greedy

    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]] * MODEL["num_hidden_layers"])
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_json(rows, 4)))
    args = [
        "--random-model",
        json.dumps(MODEL),
        "--ep-size",
        "4",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
        "--step-timeout-s",
        "4",
        "--elastic",
        "--expert-placement",
        str(path),
        "--num-redundant-experts",
        "8",
    ]
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = start_nodes(sim, 2, args)
        url = f"http://{sim.addresses[0]}:{HTTP_PORT}"
        wait_healthy(url, nodes)
        pids = set().union(*(_descendants(n.pid) for n in nodes))
        times, ended = _stream(url, "random-qwen3-moe", lambda i: i == 2 and sim.kill_host(1))
        assert ended == "finished", ended
        http = httpx.Client(trust_env=False, timeout=60)
        body = {"prompt": [7, 3, 9, 1], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        got = http.post(url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
        metrics = http.get(url + "/metrics").text
        assert got == oracle_greedy([7, 3, 9, 1], 8), got
        assert re.search(r"ep_ranks_lost\{[^}]*\} 2\.0", metrics) and re.search(r"experts_lost\{[^}]*\} 0\.0", metrics)
        stop_after_loss(nodes[0])
    finally:
        sim.close()
    _assert_all_exit(pids)
