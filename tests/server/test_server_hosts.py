"""Serving across simulated hosts (issue 28; :mod:`tests.support.hosts`): two hosts (network namespaces with their own
address and a private ``/dev/shm``), one ``torchrun --nnodes 2 --nproc-per-node 2`` per host, rendezvous on host 0's
address, the ranks' process groups on the hosts' interface (``--socket-ifname eth0``); rank 0 serves HTTP on host 0's
address and this machine asks through the real ``openai`` client. Greedy tokens equal the single-host EP 4 server's (and
transformers'); the two-node A3 commands of docs/serving-ascend.md run as written. Teardown leaves no process,
namespace, link or ``/dev/shm`` file; a host lost while serving: ``test_server_hosts_failure.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest

from tests.support import hosts
from tests.support.hosts_serving import (
    ep4_args,
    greedy,
    node_log,
    readme_commands,
    serving_on_two_hosts,
    stop_rank0,
    wait_healthy,
)
from tests.support.launch import ROOT, TORCHRUN, assert_all_exit, descendants, start_healthy, stop

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(why := hosts.unavailable()), reason=why or "-")]


def test_torchrun_two_hosts_equals_one_host(hosts_checkpoint):
    path, want = hosts_checkpoint
    args = ep4_args("--model", path, max_model_len=64)
    (one,), one_url = start_healthy(lambda port, _: [[sys.executable, "-m", "server", *args, "--port", str(port)]])
    try:
        single_host = greedy(one_url, os.path.basename(path))
    finally:
        stop([one])
    with serving_on_two_hosts(args) as (_, nodes, url):
        got = greedy(url, os.path.basename(path))
        codes = stop_rank0(nodes)
        assert codes == [0, 0], "\n".join(map(node_log, nodes))
    assert got == single_host == want


def test_a3_two_node_commands():
    """docs/serving-ascend.md's two-node A3 commands (configs/ascend_a3_2nodes.yaml, the stand-in, small shapes) as
    written, one per simulated host: node 0 answers a completion with the config's API key; SIGTERM to rank 0 stops both
    nodes."""
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
        pids = set().union(*(descendants(n.pid) for n in nodes))
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
        assert stop_rank0(nodes) == [0, 0], "\n".join(map(node_log, nodes))
    finally:
        sim.close()
    assert_all_exit(pids)
