"""``python -m server`` says what it does while it starts: one line per phase (config resolved, workers starting,
each worker ready), then ``serving MODEL on URL (EP n, backend, device)`` with the URL it really listens on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx

from tests.support.launch import ROOT, server_cmd

TINY = "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,num_key_value_heads=1,head_dim=16,num_experts=4"


def test_start_up_lines_then_serving_line() -> None:
    args = ("--ep-size", "2", "--random-model", TINY, "--served-model-name", "tiny", "--backend", "reference")
    cmd = server_cmd(*args, log_level="info")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"the server exited before serving: {lines}"
            lines.append(line.rstrip())
            if "serving tiny on" in line:
                break
        text = "\n".join(lines)
        assert "config resolved: model tiny (random weights), ep-size 2, device cpu, backend reference" in text
        assert "starting 2 EP workers" in text
        assert "EP worker 0 ready" in text and "EP worker 1 ready" in text and "(2/2)" in text
        match = re.search(r"serving tiny on (http://127\.0\.0\.1:\d+) \(EP 2, backend reference, device cpu\)", text)
        assert match, text
        assert httpx.get(match.group(1) + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
        order = [
            next(i for i, s in enumerate(lines) if key in s) for key in ("config resolved", "starting 2", "serving")
        ]
        assert order == sorted(order)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc.stderr.close()
