"""Serving on simulated hosts (:mod:`tests.support.hosts`): one ``torchrun`` per host, rank 0 serving HTTP on host 0's
address; the helpers of ``test_server_hosts*.py``."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time

import httpx
import openai
import torch

from tests.support import hosts
from tests.support.checkpoints import load_hf, make_checkpoint
from tests.support.launch import ROOT, TORCHRUN, assert_all_exit, descendants, proc_environ

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
HTTP_PORT, MASTER_PORT = 8000, 29500  # (each host has its own ports: nothing else listens there)


def node_log(proc: subprocess.Popen) -> str:
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


def ep4_args(*extra: str, max_model_len: int = 256) -> list[str]:
    """The server arguments every host test starts with (EP 4 over the 2 x 2 ranks), then ``extra``."""
    return ["--ep-size", "4", "--max-model-len", str(max_model_len), "--log-level", "warning", *extra]


@contextlib.contextmanager
def serving_on_two_hosts(server_args: list[str]):
    """2 simulated hosts x 2 torchrun ranks serving ``server_args``, healthy: yields ``(sim, nodes, url)``. Then the
    hosts are torn down and (when the body passed) every process the job started must have exited."""
    sim = hosts.SimulatedHosts(2)
    try:
        nodes = start_nodes(sim, 2, server_args)
        url = f"http://{sim.addresses[0]}:{HTTP_PORT}"
        wait_healthy(url, nodes)
        pids = set().union(*(descendants(n.pid) for n in nodes))
        yield sim, nodes, url
    finally:
        sim.close()
    assert_all_exit(pids)


def wait_healthy(url: str, nodes: list[subprocess.Popen], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in nodes:
            if p.poll() is not None:
                raise RuntimeError(f"a node exited with {p.returncode}:\n" + "\n".join(node_log(n) for n in nodes))
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server on the simulated hosts was not healthy in time:\n" + "\n".join(map(node_log, nodes)))


def stop_rank0(nodes: list[subprocess.Popen]) -> list[int]:
    """SIGTERM the HTTP rank (global rank 0): it tells the other ranks to stop and every torchrun exits; returns the
    torchruns' exit codes (a node still running after 60 s is killed: code -9)."""
    rank0 = [p for p in descendants(nodes[0].pid) if proc_environ(p).get("RANK") == "0"]
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
    ranks = [p for p in descendants(node.pid) if proc_environ(p).get("RANK") is not None]
    rank0 = [p for p in ranks if proc_environ(p).get("RANK") == "0"]
    assert len(rank0) == 1, rank0
    os.kill(rank0[0], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while [p for p in ranks if os.path.exists(f"/proc/{p}")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}")], "host 0's ranks did not exit:\n" + node_log(node)
    node.kill()
    node.wait(timeout=30)


def greedy(url: str, model: str) -> list[int]:
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


def checkpoint_and_oracle(directory: str) -> tuple[str, list[int]]:
    """A tiny Qwen3-MoE checkpoint in ``directory`` and transformers' 8 greedy tokens after :data:`PROMPT`."""
    path = make_checkpoint("qwen3_moe", directory)
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    return path, want


def stream(url: str, model: str, on_chunk) -> tuple[list[float], str]:
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


def readme_commands(marker: str) -> list[list[str]]:
    """The command lines of docs/serving-ascend.md's bash block after ``marker`` (continuation lines joined, comments
    dropped)."""
    with open(os.path.join(ROOT, "docs", "serving-ascend.md"), encoding="utf-8") as f:
        text = f.read()
    block = text[text.index(marker) :].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]
