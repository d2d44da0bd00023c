"""Servers started as their users start them (``python -m server``, ``torchrun``) in subprocesses: a free port pair
retried when another job takes it meanwhile, their output, a clean stop, and what ``/proc`` says of the processes
they leave."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from tests.support.serving import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
FAULTS = os.path.join(ROOT, "tests", "support", "faults")  # on PYTHONPATH: the fault injector (sitecustomize)
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, theirs, ...), as ``/proc`` lists them."""
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


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def assert_all_exit(pids: set[int], timeout: float = 15.0) -> None:
    """Every process of the launch exits (the forkserver helper notices its parent's exit within a few seconds)."""
    deadline = time.monotonic() + timeout
    while [p for p in pids if alive(p)]:
        assert time.monotonic() < deadline, f"orphan processes: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def proc_environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (empty once it is gone)."""
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
                raise RuntimeError(f"{p.args} exited with {p.returncode}:\n{output(p)}")
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
            stop(procs)
            taken = any(m in output(p).lower() for p in procs for m in PORT_TAKEN)
            if not isinstance(e, RuntimeError) or attempt + 1 == attempts or not taken:
                raise
    raise AssertionError("unreachable")


def stop(procs: list[subprocess.Popen], timeout: float = 30.0) -> list[int]:
    """SIGTERM the running ones, SIGKILL those still running after ``timeout``; their exit statuses."""
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


def output(proc: subprocess.Popen) -> str:
    """The last 5,000 characters ``proc`` wrote (stdout and stderr)."""
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()[-5000:]  # type: ignore[attr-defined]


def server_cmd(*args: str, port: int | str = 0, log_level: str = "warning") -> list[str]:
    """``python -m server ARGS --port PORT --log-level LOG_LEVEL``."""
    return [sys.executable, "-m", "server", *args, "--port", str(port), "--log-level", log_level]
