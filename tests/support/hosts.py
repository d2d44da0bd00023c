"""Simulated hosts: ``SimulatedHosts(n)`` makes ``n`` "hosts" on this machine, each a network namespace with its own
address on a bridge (joined by veth pairs), a private ``/dev/shm`` (a tmpfs in its own mount namespace) and its own
hostname, runs processes inside them, and tears everything down (:meth:`SimulatedHosts.close` checks that no
namespace, link or ``/dev/shm`` file is left). Needs root and ``ip``; :func:`unavailable` says why not (tests skip).

``launch(hosts, ranks_per_host, fn, *args)`` is :func:`tests.support.distributed.parallel_launch` across the hosts: one
agent process per host (started inside it) forks its ranks, which join one gloo group whose store this process hosts on
the bridge's address; host h holds ranks ``h * ranks_per_host ...``. ``fn(ProcessGroupInfo, *args)`` must be a
module-level function; its results come back in rank order.

What this proves and what it does not: the ranks of different hosts share no memory and no abstract socket and
reach each other only over IP (through the veths), as on separate machines; but it is one kernel and one CPU (no
RDMA, no HCCS, no real network latency or bandwidth).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str, check: bool = True) -> str:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True).stdout


def unavailable() -> str:
    """Why simulated hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "simulated hosts need iproute2 (ip) and util-linux (unshare)"
    probe = f"depprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError as err:
        return f"cannot create a network namespace: {err.stderr.strip()}"
    return ""


def _shm_files() -> set[str]:
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.mp-")}  # (the test runner's own queues)


class SimulatedHosts:
    """``n`` hosts (see the module docstring): host i is namespace ``names[i]``, address ``addresses[i]`` on
    interface ``eth0``; this machine reaches them at ``gateway`` (the bridge)."""

    _made = 0

    def __init__(self, n: int) -> None:
        pid, SimulatedHosts._made = os.getpid(), SimulatedHosts._made + 1  # (several at once in one process)
        self.tag = f"dep{pid % 100000:05d}{SimulatedHosts._made % 10}"
        self.subnet = f"10.{100 + pid % 100}.{((pid // 100) * 10 + SimulatedHosts._made) % 250}"
        self.gateway = f"{self.subnet}.1"
        self.names = [f"{self.tag}h{i}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{10 + i}" for i in range(n)]
        self.bridge = f"{self.tag}b"
        self.procs: list[subprocess.Popen] = []
        self._shm_before = _shm_files()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", self.veth(i), "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # a lost host's peers' sockets give up at once (they would keep the namespace alive for minutes)
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "sysctl",
                        "-qw",
                        "net.ipv4.tcp_orphan_retries=1",
                        "net.ipv4.tcp_fin_timeout=1",
                    ],
                    check=True,
                )
        except BaseException:
            self.close(check=False)
            raise

    def veth(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``: its network namespace, a new mount namespace with a fresh tmpfs on
        ``/dev/shm``, and a UTS namespace named ``simhost<host>``."""
        inner = f'mount -t tmpfs -o size=1g tmpfs /dev/shm && hostname simhost{host} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.names[host],
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            inner,
            "sh",
            *argv,
        ]

    def start(self, host: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (its own process group: :meth:`kill_host` ends it all)."""
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **popen)
        proc.host = host  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def kill_host(self, host: int) -> None:
        """Kill every process running in host ``host`` (a host that dies): every process of its network
        namespace, whatever session it made for itself."""
        pids = _ip("netns", "pids", self.names[host], check=False).split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs:
            if proc.host == host:  # type: ignore[attr-defined]
                proc.wait()

    def cut(self, host: int) -> None:
        """Cut host ``host``'s link (its processes live on, unreachable)."""
        _ip("link", "set", self.veth(host), "down")

    def uncut(self, host: int) -> None:
        """Restore host ``host``'s link."""
        _ip("link", "set", self.veth(host), "up")

    def leftovers(self) -> list[str]:
        """Namespaces, links and ``/dev/shm`` files of these hosts still present."""
        found = [n for n in _ip("netns", "list", check=False).split() if n.startswith(self.tag)]
        found += [n for n in _ip("-o", "link", "show", check=False).split() if n.startswith(self.tag)]
        found += sorted(_shm_files() - self._shm_before)
        return found

    def close(self, check: bool = True) -> None:
        """Kill what still runs, delete the namespaces, the veths and the bridge; with ``check``, AssertionError
        if anything is left."""
        for host in range(len(self.names)):
            self.kill_host(host)
        for i, ns in enumerate(self.names):
            _ip("link", "del", self.veth(i), check=False)  # (both ends: the namespace may outlive its name a while)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if check:
            deadline = time.monotonic() + 5
            while (left := self.leftovers()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, f"simulated hosts left behind: {left}"


def launch(
    hosts: SimulatedHosts,
    ranks_per_host: int,
    fn: Callable,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    allow_exit: tuple[int, ...] = (),
) -> list:
    """Run ``fn(ProcessGroupInfo, *args)`` on ``len(hosts.names) * ranks_per_host`` gloo ranks spread over the hosts
    (see the module docstring); their results in rank order (None for the ranks of ``allow_exit`` that exited without
    one: failure tests' victims). RuntimeError with every failing rank's traceback,
    TimeoutError when a rank did not finish within ``timeout`` seconds (every agent is killed)."""
    import torch.distributed as dist

    world = len(hosts.names) * ranks_per_host
    store = dist.TCPStore(
        "0.0.0.0", 0, world, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=pg_timeout)
    )
    with tempfile.TemporaryDirectory(prefix="deep_ep_npu-hosts-") as tmp:
        spec = os.path.join(tmp, "spec.pkl")
        with open(spec, "wb") as f:
            pickle.dump((fn, args, world, ranks_per_host, hosts.gateway, store.port, pg_timeout, tmp), f)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": REPO}
        agents = [
            hosts.start(h, [sys.executable, "-m", "tests.support.hosts", spec, str(h)], env=env, cwd=REPO)
            for h in range(len(hosts.names))
        ]
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[bool, Any]] = {}
        for r in allow_exit:
            results.setdefault(r, (True, None))  # (replaced if it reports)
        while len(results) < world and time.monotonic() < deadline:
            for r in range(world):
                path = os.path.join(tmp, f"rank{r}.pkl")
                if (r not in results or r in allow_exit) and os.path.exists(path):
                    with open(path, "rb") as f:
                        results[r] = _loads(f.read())
            if all(a.poll() is not None for a in agents) and len(results) < world:
                time.sleep(0.2)  # (a result written just before its agent exited)
                if not all(os.path.exists(os.path.join(tmp, f"rank{r}.pkl")) for r in range(world)):
                    break
            time.sleep(0.05)
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=5 if len(results) == world else 0.1)
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    del store
    if failures := {r: out for r, (ok, out) in sorted(results.items()) if not ok}:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        raise RuntimeError(f"{len(failures)} of {world} ranks failed:\n{text}")
    if len(results) < world:
        stuck = [r for r in range(world) if r not in results]
        raise TimeoutError(f"ranks {stuck} gave no result within {timeout:.0f}s")
    return [results[r][1] for r in range(world)]


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank(rank: int, spec: tuple) -> None:
    """One rank inside its host (forked by the agent): join the group, run the function, write the result."""
    import torch
    import torch.distributed as dist

    from tests.support.distributed import ProcessGroupInfo

    fn, args, world, _, gateway, port, pg_timeout, tmp = spec
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore(gateway, port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            out: tuple[bool, Any] = (True, fn(ProcessGroupInfo(rank, world, dist.group.WORLD, port), *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - forwarded to the launcher with its traceback
        out = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    buf = io.BytesIO()
    torch.save(out, buf)
    with open(os.path.join(tmp, f"rank{rank}.part"), "wb") as f:
        f.write(buf.getvalue())
    os.replace(os.path.join(tmp, f"rank{rank}.part"), os.path.join(tmp, f"rank{rank}.pkl"))


def _agent(spec_path: str, host: int) -> None:
    """A host's agent: fork its ranks (they share its namespaces) and wait for them."""
    import multiprocessing as mp

    import torch  # noqa: F401 - imported once, before the fork

    import deep_ep_npu  # noqa: F401

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    per_host = spec[3]
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=_rank, args=(host * per_host + i, spec)) for i in range(per_host)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()


if __name__ == "__main__":
    _agent(sys.argv[1], int(sys.argv[2]))
