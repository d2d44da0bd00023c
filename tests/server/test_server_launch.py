"""The real command lines: ``python -m server --config configs/default.yaml`` and a two-"node" ``torchrun`` launch
on loopback (one process per rank, rank 0 hosts HTTP). Each server is stopped with SIGTERM and must leave no
processes behind."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch

from tests.support.checkpoints import load_hf, make_checkpoint
from tests.support.launch import (
    TORCHRUN,
    assert_all_exit,
    descendants,
    output,
    proc_environ,
    server_cmd,
    start_healthy,
    stop,
)
from tests.support.serving import greedy


def _serve_once(args: list[str], body: dict, **headers: str) -> tuple[int, dict]:
    """``python -m server ARGS`` on a free port: the number of processes it started and the response to ``body``;
    then SIGTERM, exit status 0 and no process left behind."""
    (proc,), url = start_healthy(lambda port, _: [server_cmd(*args, port=port)])
    try:
        workers = descendants(proc.pid)
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        (code,) = stop([proc])
    assert code == 0, output(proc)
    assert_all_exit(workers)
    return len(workers), r.json()


def test_python_m_server_default_config():
    num_workers, r = _serve_once(["--config", "configs/default.yaml"], greedy("Hello", 5))
    assert num_workers >= 2  # the two EP workers
    assert len(r["choices"][0]["token_ids"]) == 5 and r["model"] == "random-qwen3-moe"


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
        body = greedy(prompt, 8)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        pids = descendants(nodes[0].pid) | descendants(nodes[1].pid)
        rank0 = [p for p in descendants(nodes[0].pid) if proc_environ(p).get("RANK") == "0"]
        assert len(rank0) == 1
        os.kill(rank0[0], signal.SIGTERM)  # stop the HTTP rank; it tells rank 1 to stop; both agents exit cleanly
        codes = [n.wait(timeout=60) for n in nodes]
    finally:
        stop(nodes)  # no-op unless something above failed
    assert codes == [0, 0], "\n".join(output(p) for p in nodes)
    assert_all_exit(pids)


A3_SMALL = (
    '{"architecture": "qwen3_moe", "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32, '
    '"num_experts": 16, "num_experts_per_tok": 8}'
)


def test_ascend_a3_config_on_the_stand_in():
    """docs/serving-ascend.md's laptop command: configs/ascend_a3.yaml (device npu, dist-backend hccl) with
    --simulate-npu and small-shape overrides serves a completion (the Ascend backend on the NPU stand-in, on CPU over
    gloo) and stops cleanly on SIGTERM."""
    args = ["--config", "configs/ascend_a3.yaml", "--simulate-npu", "--ep-size", "2", "--max-num-seqs", "8"]
    args += ["--max-model-len", "512", "--random-model", A3_SMALL]
    body = {"model": "a3-moe", "prompt": "Hello, Ascend!", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    _, r = _serve_once(args, body, Authorization="Bearer change-me")
    assert len(r["choices"][0]["token_ids"]) == 8
