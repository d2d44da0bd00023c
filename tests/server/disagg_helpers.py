"""Helpers of the disaggregation tests: a small random model's options, metric reads, TCP connection counts."""

from __future__ import annotations

import re

import httpx

RANDOM_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "moe_intermediate_size": 32,
}
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
