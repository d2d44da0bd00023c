"""The driver's handle on the W workers, stepping them in lockstep: locally spawned processes (private pipes) or a
``torchrun`` job (rank 0 = driver + worker 0; plans go out with ``broadcast_object_list`` over a gloo group)."""

from __future__ import annotations

import abc
import contextlib
import datetime
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import wait
from typing import Any

from .worker import StepPlan, StepResult, Worker, WorkerArgs, worker_main


class WorkerError(RuntimeError):
    """A worker failed (its traceback is in the message) or stopped answering; all workers have been stopped."""


class WorkerGroup(abc.ABC):
    infos: list[dict]

    @abc.abstractmethod
    def step(self, plans: list[StepPlan]) -> list[StepResult]:
        """Run one plan per worker (all step together); raise :class:`WorkerError` if any fails."""

    @abc.abstractmethod
    def is_alive(self) -> bool: ...

    @abc.abstractmethod
    def ping(self, timeout_s: float) -> None:
        """Check that every worker answers within ``timeout_s`` (a hung one does not); raise :class:`WorkerError`
        and stop all workers if one does not. Between steps only."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessWorkers(WorkerGroup):
    """W worker processes started from a forkserver (torch preloaded), one pipe each."""

    def __init__(
        self, world_size: int, args: WorkerArgs, start_timeout_s: float = 300.0, step_timeout_s: float = 600.0
    ) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "server.runtime.worker"])
        port = _free_port()
        self.step_timeout_s = step_timeout_s
        self.conns, self.procs = [], []
        self._closed = False
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, world_size, port, child, args),
                    daemon=True,
                    name=f"ep-worker-{rank}",
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self.infos = [info for _, info in self._collect("ready", start_timeout_s)]
        except BaseException:
            self.shutdown()
            raise

    def _collect(self, expect: str, timeout_s: float) -> list[tuple[str, Any]]:
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.conns):
            pending = {c: r for r, c in enumerate(self.conns) if r not in replies}
            ready = wait(
                list(pending) + [self.procs[r].sentinel for r in pending.values()],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                self._abort()
                raise WorkerError(f"workers {sorted(pending.values())} did not answer within {timeout_s:g}s (hung?)")
            for obj in ready:
                rank = pending.get(obj)  # type: ignore[call-overload]
                if rank is None:  # a process sentinel: it died; its error message may still be in the pipe
                    rank = next(r for r in pending.values() if self.procs[r].sentinel == obj)
                    if not self.conns[rank].poll():
                        self._abort()
                        raise WorkerError(f"worker {rank} exited with code {self.procs[rank].exitcode}")
                try:
                    kind, payload = self.conns[rank].recv()
                except (EOFError, OSError):  # closed (EOF) or reset by the dying process
                    self.procs[rank].join(timeout=1.0)
                    self._abort()
                    raise WorkerError(f"worker {rank} exited with code {self.procs[rank].exitcode}") from None
                if kind == "error":
                    self._abort()
                    raise WorkerError(payload)
                replies[rank] = (kind, payload)
        return [replies[r] for r in range(len(self.conns))]

    def step(self, plans: list[StepPlan]) -> list[StepResult]:
        if self._closed:
            raise WorkerError("the workers were shut down")
        self._send_all([("step", plan) for plan in plans])
        return [payload for _, payload in self._collect("ok", self.step_timeout_s)]

    def is_alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self.procs)

    def ping(self, timeout_s: float) -> None:
        if self._closed:
            raise WorkerError("the workers were shut down")
        self._send_all([("ping", None)] * len(self.conns))
        self._collect("pong", timeout_s)

    def _send_all(self, messages: list[tuple[str, Any]]) -> None:
        for rank, (conn, message) in enumerate(zip(self.conns, messages, strict=True)):
            try:
                conn.send(message)
            except OSError:  # its end of the pipe is closed: the process has exited
                self.procs[rank].join(timeout=1.0)
                self._abort()
                raise WorkerError(f"worker {rank} exited with code {self.procs[rank].exitcode}") from None

    def _abort(self) -> None:
        """Stop every worker at once after a failure: the others may be stuck in a collective with the failed one."""
        self.shutdown(grace_s=0.0)

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every worker to stop, wait up to ``grace_s``, then kill what is left (no orphans)."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self.conns, self.procs, strict=False):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("stop", None))
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()


def torchrun_env() -> bool:
    """True when launched by ``torchrun`` (RANK, WORLD_SIZE and MASTER_ADDR are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _init_torchrun(args: WorkerArgs) -> tuple[int, int, Any, Worker, bool]:
    """Join the torchrun job's default group (unless already joined), make the control group, build the shard."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    return rank, world_size, control, Worker(args, rank, world_size, dist.group.WORLD), owns_group


class TorchrunWorkers(WorkerGroup):
    """Rank 0 of a ``torchrun`` job: this process is worker 0; ranks > 0 run :func:`run_worker_from_env`.

    A failing rank > 0 reports its traceback at the end of the step; one that fails inside a collective leaves its
    peers waiting until the gloo timeout (``dist_timeout_s``), which then fails the step here.
    """

    def __init__(self, args: WorkerArgs) -> None:
        import torch.distributed as dist

        self.dist = dist
        rank, self.world_size, self.control, self.worker, self._owns_group = _init_torchrun(args)
        assert rank == 0, "TorchrunWorkers runs on rank 0; call run_worker_from_env() on the other ranks"
        infos: list[Any] = [None] * self.world_size
        dist.gather_object(self.worker.info, infos, dst=0, group=self.control)
        self.infos = infos
        self._closed = False

    def step(self, plans: list[StepPlan]) -> list[StepResult]:
        self.dist.broadcast_object_list([("step", plans)], src=0, group=self.control)
        local = self.worker.execute(plans[0])
        results: list[Any] = [None] * self.world_size
        self.dist.gather_object(("ok", local), results, dst=0, group=self.control)
        for kind, payload in results:
            if kind == "error":
                raise WorkerError(payload)
        return [payload for _, payload in results]

    def is_alive(self) -> bool:
        return not self._closed

    def ping(self, timeout_s: float) -> None:
        """Not checked between steps: a hung rank > 0 fails the next step after the gloo timeout."""
        if self._closed:
            raise WorkerError("the workers were shut down")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.dist.broadcast_object_list([("stop", None)], src=0, group=self.control)
        self.worker.close()
        self.dist.destroy_process_group(self.control)
        if self._owns_group:
            self.dist.destroy_process_group()


def run_worker_from_env(args: WorkerArgs) -> None:
    """The loop of a ``torchrun`` rank > 0: receive this rank's plan from rank 0 each step until told to stop."""
    import traceback

    import torch.distributed as dist

    rank, _, control, worker, owns_group = _init_torchrun(args)
    dist.gather_object(worker.info, None, dst=0, group=control)
    while True:
        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=0, group=control)
        kind, plans = msg[0]
        if kind == "stop":
            break
        try:
            reply: tuple[str, Any] = ("ok", worker.execute(plans[rank]))
        except Exception:  # noqa: BLE001 - reported to rank 0 with the traceback
            reply = ("error", f"worker {rank} failed:\n{traceback.format_exc()}")
        dist.gather_object(reply, None, dst=0, group=control)
        if reply[0] == "error":
            break
    worker.close()
    dist.destroy_process_group(control)
    if owns_group:
        dist.destroy_process_group()
