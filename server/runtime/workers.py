"""The driver's handle on the W workers, stepping them in lockstep: locally spawned processes (private pipes,
:class:`ProcessWorkers`) or a ``torchrun`` job (:mod:`.torchrun`)."""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from .engine_config import EngineConfig
from .plan import StepPlan, StepResult, WorkerInfo
from .rendezvous import serve_loopback_store
from .worker_loop import worker_main

logger = logging.getLogger("server.engine")


class WorkerError(RuntimeError):
    """A worker failed (its traceback is in the message) or stopped answering; all workers have been stopped."""


class WorkerGroup(abc.ABC):
    infos: list[WorkerInfo]
    lost: dict[int, str]  # elastic mode: lost worker rank -> why

    overlaps: bool  # submit() returns while the workers run (the driver can plan the next step meanwhile)

    @abc.abstractmethod
    def submit(self, plans: list[StepPlan]) -> None:
        """Start one step: one plan per worker (all step together). Steps run in the order submitted."""

    @abc.abstractmethod
    def collect(self) -> list[StepResult | None]:
        """The results of the oldest submitted step not collected yet; raise :class:`WorkerError` if a worker
        fails. A None result: that worker is lost (elastic mode)."""

    def step(self, plans: list[StepPlan]) -> list[StepResult | None]:
        """Submit one step and wait for its results (nothing else in flight)."""
        self.submit(plans)
        return self.collect()

    @abc.abstractmethod
    def is_alive(self) -> bool: ...

    @abc.abstractmethod
    def ping(self, timeout_s: float) -> None:
        """Check that every worker answers within ``timeout_s`` (a hung one does not); raise :class:`WorkerError`
        and stop all workers if one does not. Between steps only."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class ProcessWorkers(WorkerGroup):
    """W worker processes started from a forkserver (torch preloaded), one pipe each.

    ``elastic``: once started, a worker that dies, hangs past the timeout or fails is *lost* instead of failing the
    group, as long as another one is left: it is killed, ``lost[rank]`` says why (logged as a warning), it gets no
    more plans and its slot in :meth:`step`'s results is None. The survivors' Buffers (``enable_shrink``) regroup
    without it and drop its experts.
    """

    def __init__(self, args: EngineConfig, start_timeout_s: float = 300.0) -> None:
        """``args.ep_size`` workers; ``args.step_timeout_s`` bounds each step and ping, ``args.elastic`` as above."""
        world_size, step_timeout_s, elastic = args.ep_size, args.step_timeout_s, args.elastic
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "server.runtime.worker_loop"])
        self.step_timeout_s = step_timeout_s
        self.conns, self.procs = [], []
        self.lost: dict[int, str] = {}
        self.overlaps = True
        self._num_inflight = 0
        self.elastic = False  # a failure while starting fails the group
        self._closed = False
        try:
            self._store, port = serve_loopback_store(world_size, args.dist_timeout_s)
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
            logger.info("starting %d EP workers (pids %s); each loads the shared weights and its own experts",
                        world_size, [p.pid for p in self.procs])  # fmt: skip
            started = time.monotonic()

            def ready(rank: int, info: WorkerInfo, num_ready: int) -> None:
                logger.info("EP worker %d ready (%d/%d) after %.1f s: %d local experts, %.1f MiB of weights, KV cache "
                            "%d blocks (%.1f MiB) on %s", rank, num_ready, world_size, time.monotonic() - started,
                            info.num_local_experts, info.weight_bytes / 2**20, info.num_kv_blocks,
                            info.kv_cache_bytes / 2**20, info.device)  # fmt: skip

            replies = self._collect(start_timeout_s, on_reply=ready)
            self.infos = [replies[r] for r in sorted(replies)]
        except BaseException:
            self.shutdown()
            raise
        self.elastic = elastic

    def _live(self) -> list[int]:
        return [r for r in range(len(self.conns)) if r not in self.lost]

    def _failed(self, ranks: list[int], why: str) -> None:
        """``ranks`` failed: lose them (elastic, survivors left) or stop every worker and raise."""
        if not self.elastic or not [r for r in self._live() if r not in ranks]:
            self._abort()
            raise WorkerError(why)
        for rank in ranks:
            logger.warning("elastic: EP worker %d is lost (%s); serving continues on workers %s without its experts",
                           rank, why.splitlines()[0], [r for r in self._live() if r not in ranks])  # fmt: skip
            if self.procs[rank].is_alive():
                self.procs[rank].kill()
                self.procs[rank].join(timeout=5.0)
            self.conns[rank].close()
            self.lost[rank] = why.splitlines()[0]

    def _collect(self, timeout_s: float, on_reply: Callable[[int, Any, int], None] | None = None) -> dict[int, Any]:
        """Every live worker's next reply payload, by rank (failed ones are lost or raise, see :meth:`_failed`);
        ``on_reply(rank, payload, num_replies)`` is called as each arrives."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            pending = {self.conns[r]: r for r in self._live() if r not in replies}
            if not pending:
                return replies
            ready = wait(
                list(pending) + [self.procs[r].sentinel for r in pending.values()],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                ranks = sorted(pending.values())
                self._failed(ranks, f"workers {ranks} did not answer within {timeout_s:g}s (hung?)")
            for obj in ready:
                rank = pending.get(obj)  # type: ignore[call-overload]
                if rank is None:  # a process sentinel: it died; its error message may still be in the pipe
                    rank = next(r for r in pending.values() if self.procs[r].sentinel == obj)
                if rank in self.lost or rank in replies:  # both its pipe and its sentinel were ready
                    continue
                if not self.conns[rank].poll():
                    self._failed([rank], f"worker {rank} exited with code {self.procs[rank].exitcode}")
                    continue
                try:
                    kind, payload = self.conns[rank].recv()
                except (EOFError, OSError):  # closed (EOF) or reset by the dying process
                    self.procs[rank].join(timeout=1.0)
                    self._failed([rank], f"worker {rank} exited with code {self.procs[rank].exitcode}")
                    continue
                if kind == "error":
                    self._failed([rank], payload)
                    continue
                replies[rank] = payload
                if on_reply is not None:
                    on_reply(rank, payload, len(replies))

    def submit(self, plans: list[StepPlan]) -> None:
        if self._closed:
            raise WorkerError("the workers were shut down")
        self._send_all({r: ("step", plans[r]) for r in self._live()})
        self._num_inflight += 1

    def collect(self) -> list[StepResult | None]:
        assert self._num_inflight > 0, "collect() without a submitted step"
        self._num_inflight -= 1
        replies = self._collect(self.step_timeout_s)
        return [replies.get(r) for r in range(len(self.conns))]

    def is_alive(self) -> bool:
        return not self._closed and all(self.procs[r].is_alive() for r in self._live())

    def ping(self, timeout_s: float) -> None:
        """Between steps only: with a step in flight, only checks that every live worker process is alive."""
        if self._closed:
            raise WorkerError("the workers were shut down")
        if self._num_inflight:
            dead = [r for r in self._live() if not self.procs[r].is_alive()]
            if dead:
                self._failed(dead, f"worker {dead[0]} exited with code {self.procs[dead[0]].exitcode}")
            return
        self._send_all({r: ("ping", None) for r in self._live()})
        self._collect(timeout_s)

    def _send_all(self, messages: dict[int, tuple[str, Any]]) -> None:
        for rank, message in messages.items():
            try:
                self.conns[rank].send(message)
            except OSError:  # its end of the pipe is closed: the process has exited
                self.procs[rank].join(timeout=1.0)
                self._failed([rank], f"worker {rank} exited with code {self.procs[rank].exitcode}")

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
        self._store = None
