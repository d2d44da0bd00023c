"""The real command lines: ``python -m server --config configs/default.yaml`` and a two-"node" ``torchrun`` launch
on loopback (one process per rank, rank 0 hosts HTTP). Each server is stopped with SIGTERM and must leave no
processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
import pytest
import torch

from tests.server.test_models_ckpt import load_hf, make_checkpoint
from tests.support.serving import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out.update(kids)
            todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _assert_all_exit(pids: set[int], timeout: float = 15.0) -> None:
    """Every process of the launch exits (the forkserver helper notices its parent's exit within a few seconds)."""
    deadline = time.monotonic() + timeout
    while [p for p in pids if _alive(p)]:
        assert time.monotonic() < deadline, f"orphan processes: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode}:\n{_output(p)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server not healthy in time")


PORT_TAKEN = ("address already in use", "eaddrinuse", "failed to listen")  # a port another job bound meanwhile


def start_healthy(
    make_cmds: Callable[[int, int], list[list[str]]], attempts: int = 3, env: dict[str, str] | None = None
) -> tuple[list[subprocess.Popen], str]:
    """Start the processes ``make_cmds(http_port, master_port)`` gives (``env``: added to their environment) and
    wait until HTTP is healthy; returns them and the URL. The ports are picked free but closed before the server
    binds them, so another job may take one in between: a launch that fails because its port is taken is retried on
    new ports."""
    for attempt in range(attempts):
        port, master = free_port(), free_port()
        procs = [_popen(cmd, env) for cmd in make_cmds(port, master)]
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, procs)
            return procs, url
        except BaseException as e:  # (a slow start's TimeoutError too: nothing is left running)
            _stop(procs)
            taken = any(m in _output(p).lower() for p in procs for m in PORT_TAKEN)
            if not isinstance(e, RuntimeError) or attempt + 1 == attempts or not taken:
                raise
    raise AssertionError("unreachable")


def _stop(procs: list[subprocess.Popen], timeout: float = 30.0) -> list[int]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def _popen(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output in a temporary file (a pipe nobody reads could fill up and block it)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _output(proc: subprocess.Popen) -> str:
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()[-5000:]  # type: ignore[attr-defined]


def test_python_m_server_default_config():
    (proc,), url = start_healthy(
        lambda port, _: [
            [
                sys.executable,
                "-m",
                "server",
                "--config",
                "configs/default.yaml",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
        ]
    )
    try:
        workers = _descendants(proc.pid)
        assert len(workers) >= 2  # the two EP workers
        body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 5
        assert r.json()["model"] == "random-qwen3-moe"
    finally:
        (code,) = _stop([proc])
    assert code == 0, _output(proc)
    _assert_all_exit(workers)


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
@pytest.mark.parametrize("extra", [[], ["--backend", "ascend", "--simulate-npu"]], ids=["reference", "ascend-sim"])
def test_torchrun_two_nodes_on_loopback(tmp_path, extra: list[str]):
    """Node 0 and node 1 are two torchrun invocations (one rank each) joined through a c10d rendezvous on
    127.0.0.1; rank 0 serves HTTP and greedy tokens equal transformers' on the checkpoint both nodes read. Also with
    ``--backend ascend --simulate-npu`` (every rank installs the NPU stand-in; the MoE runs the Ascend backend)."""
    path = make_checkpoint("qwen3_moe", str(tmp_path / "ckpt"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    nodes, url = start_healthy(
        lambda port, master: [
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(master),
                "-m",
                "server",
                "--model",
                path,
                "--ep-size",
                "2",
                "--port",
                str(port),
                "--max-model-len",
                "64",
                "--log-level",
                "warning",
                *extra,
            ]
            for node in (0, 1)
        ]
    )
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        pids = _descendants(nodes[0].pid) | _descendants(nodes[1].pid)
        rank0 = [p for p in _descendants(nodes[0].pid) if _environ(p).get("RANK") == "0"]
        assert len(rank0) == 1
        os.kill(rank0[0], signal.SIGTERM)  # stop the HTTP rank; it tells rank 1 to stop; both agents exit cleanly
        codes = [n.wait(timeout=60) for n in nodes]
    finally:
        _stop(nodes)  # no-op unless something above failed
    assert codes == [0, 0], "\n".join(_output(p) for p in nodes)
    _assert_all_exit(pids)


A3_SMALL = (
    '{"architecture": "qwen3_moe", "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32, '
    '"num_experts": 16, "num_experts_per_tok": 8}'
)


def test_ascend_a3_config_on_the_stand_in():
    """docs/serving-ascend.md's laptop command: configs/ascend_a3.yaml (device npu, dist-backend hccl) with
    --simulate-npu and small-shape overrides serves a completion (the Ascend backend on the NPU stand-in, on CPU over
    gloo) and stops cleanly on SIGTERM."""
    (proc,), url = start_healthy(
        lambda port, _: [
            [
                sys.executable,
                "-m",
                "server",
                "--config",
                "configs/ascend_a3.yaml",
                "--simulate-npu",
                "--ep-size",
                "2",
                "--max-num-seqs",
                "8",
                "--max-model-len",
                "512",
                "--port",
                str(port),
                "--random-model",
                A3_SMALL,
                "--log-level",
                "warning",
            ]
        ]
    )
    try:
        workers = _descendants(proc.pid)
        body = {
            "model": "a3-moe",
            "prompt": "Hello, Ascend!",
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer change-me"}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 8
    finally:
        (code,) = _stop([proc])
    assert code == 0, _output(proc)
    _assert_all_exit(workers)
