"""Helpers of the disaggregation tests: a small random model's options, metric reads, TCP connection counts, a
``python -m server`` instance in a subprocess, streamed requests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx

from tests.support.launch import ROOT, server_cmd
from tests.support.serving import free_port, greedy

RANDOM_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "moe_intermediate_size": 32,
}
TIMEOUT_S = 6.0  # --disaggregation-timeout-s: the bound on every wait between the two sides
# independent of the code under test: layers x (keys + values) x kv heads x head_dim x float32
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def metric(url: str, name: str, **labels: str) -> float:
    """The value of ``deep_ep_npu:<name>`` (with ``labels``) in ``url``'s /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        match = re.match(r"deep_ep_npu:" + re.escape(name) + r"(\{[^}]*\})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no metric {name} {labels} at {url}")


def established(port: int) -> int:
    """TCP connections of this host in state ESTABLISHED whose local or remote port is ``port``."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                local, remote, state = fields[1], fields[2], fields[3]
                if state == "01" and port in (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)):
                    count += 1
    return count


class Instance:
    """``python -m server`` in a subprocess (its log in ``log_path``), with its URL once it serves."""

    def __init__(self, tmp_path, name: str, *args: str, model: dict = RANDOM_MODEL, env: dict | None = None) -> None:
        self.log_path = tmp_path / f"{name}.log"
        self.bootstrap_port = free_port() if "prefill" in args else None
        timeout = str(TIMEOUT_S)
        cmd = server_cmd(
            *("--random-model", json.dumps(model), "--max-num-seqs", "8", "--max-model-len", "1100"),
            *("--kv-cache-memory", "32M", "--backend", "reference", "--ep-size", "1"),
            *("--disaggregation-timeout-s", timeout, *args),
            log_level="info",
        )
        if self.bootstrap_port is not None:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self.url = ""

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 120
        while not self.url:
            match = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if match:
                self.url = match.group(1)
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the instance did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server process (its workers notice their pipe closing and exit)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def serving(instances: list[Instance]) -> Iterator[list[Instance]]:
    """``instances`` once each serves; on exit, SIGTERM to those still running, and each must exit with 0."""
    try:
        for instance in instances:
            instance.wait_serving()
        yield instances
    finally:
        for instance in instances:
            if instance.proc.poll() is None:
                instance.proc.send_signal(signal.SIGTERM)
                assert instance.proc.wait(timeout=30) == 0, instance.log_path.read_text()[-3000:]


def stream(url: str, body: dict, out: dict) -> None:
    """POST a streamed completion; ``out``: ``tokens``, ``token_ids``, ``error`` (the error event's message),
    ``seconds``."""
    t0 = time.monotonic()
    out.update(tokens=0, token_ids=[], error=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            if r.status_code != 200:
                out["error"] = json.loads(r.read())["error"]["message"]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]["message"]
                    else:
                        out["token_ids"] += event["choices"][0]["token_ids"]
                        out["tokens"] += len(event["choices"][0]["token_ids"])
    except httpx.HTTPError as e:
        out["error"] = f"broken: {e!r}"
    out["seconds"] = time.monotonic() - t0


def body(i: int, n: int, max_tokens: int) -> dict:
    """A greedy request of ``n`` prompt tokens drawn from ``i``."""
    return greedy([(i * 31 + j * 7) % 240 + 1 for j in range(n)], max_tokens)
