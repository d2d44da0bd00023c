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
from typing import Any, NoReturn

from server.runtime.engine_config import EngineConfig
from server.runtime.scheduling.plan import StepPlan, StepResult, WorkerInfo
from server.runtime.workers.heartbeat import PATIENCE, STALE_S
from server.runtime.workers.rendezvous import serve_loopback_store
from server.runtime.workers.worker_loop import worker_main

logger = logging.getLogger("server.engine")

MAX_REGROUPS = 3
"""Regroups one step may take (a rank failing while the others regroup or run it again) before it fails the group."""

Reply = tuple[str, Any]  # a worker's answer to a step or a regroup: ("ok", StepResult | None) or ("aborted", why)


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

    world_size: int
    elastic: bool
    _regrouped: frozenset[int] = frozenset()  # the lost ranks the live ones last regrouped without

    @abc.abstractmethod
    def _regroup(self, members: list[int], rerun: bool) -> dict[int, Reply]:
        """Send every live worker ``("regroup", (members, rerun))`` and return the replies of those that answered
        (the others are lost, or fail the group)."""

    @abc.abstractmethod
    def _fail_all(self, why: str) -> NoReturn:
        """Stop every worker and raise :class:`WorkerError` with ``why``."""

    def _settle(self, replies: dict[int, Reply]) -> list[StepResult | None]:
        """A step's results from its replies. The step stands when every live worker finished it with the ranks it
        started with. Otherwise (a rank failure interrupted a worker's forward, an EPLB exchange failed, or a rank
        was lost), elastic mode has every live worker regroup on the live ranks at this step boundary and, if a
        forward was interrupted, run the step again there: tokens are only ever sampled with every expert that has
        a live replica. Anything else fails the group visibly (also after :data:`MAX_REGROUPS` tries)."""
        results = {r: payload for r, (kind, payload) in replies.items() if kind == "ok"}
        rerun = any(kind == "aborted" for kind, _ in replies.values())
        why = [res.regroup for res in results.values() if res is not None and res.regroup]
        for attempt in range(MAX_REGROUPS + 1):
            why += [p for kind, p in replies.values() if kind == "aborted"]
            newly_lost = set(self.lost) - self._regrouped
            if not why and not newly_lost:
                return [None if r in self.lost else results[r] for r in range(self.world_size)]
            if not self.elastic or attempt == MAX_REGROUPS:
                tried = f" (after {attempt} regroups)" if attempt else ""
                self._fail_all("; ".join(why or [self.lost[r] for r in sorted(newly_lost)]) + tried)
            members = [r for r in range(self.world_size) if r not in self.lost]
            logger.warning(
                "elastic: EP workers %s regroup%s (%s)",
                members,
                " and run the step again" * rerun,
                "; ".join(w.splitlines()[0] for w in why) or f"lost: {sorted(newly_lost)}",
            )
            self._regrouped = frozenset(self.lost)
            replies, why = self._regroup(members, rerun), []
            if rerun:
                results = {r: payload for r, (kind, payload) in replies.items() if kind == "ok"}
        raise AssertionError("unreachable")

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
    more plans and its slot in :meth:`step`'s results is None. The survivors regroup without it at that step boundary
    (:meth:`WorkerGroup._settle`): their experts' tokens go to surviving replicas, experts without one are dropped.
    Steps are then not pipelined (``overlaps`` is False): a step stands only once every live worker answered.
    """

    def __init__(self, args: EngineConfig, start_timeout_s: float = 300.0) -> None:
        """``args.ep_size`` workers; ``args.step_timeout_s`` bounds each step and ping, ``args.elastic`` as above."""
        world_size, step_timeout_s, elastic = args.ep_size, args.step_timeout_s, args.elastic
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "server.runtime.workers.worker_loop"])
        self.step_timeout_s = step_timeout_s
        self.conns, self.procs = [], []
        self._beats: list[Any] = []  # per worker: a shared double, the time of its last heartbeat (time.monotonic)
        self.lost: dict[int, str] = {}
        self.world_size = world_size
        self.overlaps = not elastic  # (elastic: a step stands only once every worker answered; see _settle)
        self._num_inflight = 0
        self.elastic = False  # a failure while starting fails the group
        self._closed = False
        try:
            self._store, port = serve_loopback_store(world_size, args.dist_timeout_s)
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                self._beats.append(ctx.Value("d", time.monotonic(), lock=False))
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, world_size, port, child, args, self._beats[-1]),
                    daemon=True,
                    name=f"ep-worker-{rank}",
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            logger.info(
                "starting %d EP workers (pids %s); each loads the shared weights and its own experts",
                world_size,
                [p.pid for p in self.procs],
            )
            started = time.monotonic()

            def ready(rank: int, info: WorkerInfo, num_ready: int) -> None:
                logger.info(
                    "EP worker %d ready (%d/%d) after %.1f s: %d local experts, %.1f MiB of weights, KV cache "
                    "%d blocks (%.1f MiB) on %s",
                    rank,
                    num_ready,
                    world_size,
                    time.monotonic() - started,
                    info.num_local_experts,
                    info.weight_bytes / 2**20,
                    info.num_kv_blocks,
                    info.kv_cache_bytes / 2**20,
                    info.device,
                )

            replies = self._collect(start_timeout_s, on_reply=ready)
            self.infos = [replies[r][1] for r in sorted(replies)]
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
            logger.warning(
                "elastic: EP worker %d is lost (%s); serving continues on workers %s without its experts",
                rank,
                why.splitlines()[0],
                [r for r in self._live() if r not in ranks],
            )
            if self.procs[rank].is_alive():
                self.procs[rank].kill()
                self.procs[rank].join(timeout=5.0)
            self.conns[rank].close()
            self.lost[rank] = why.splitlines()[0]

    def _collect(self, timeout_s: float, on_reply: Callable[[int, Any, int], None] | None = None) -> dict[int, Reply]:
        """Every live worker's next reply ``(kind, payload)``, by rank (failed ones are lost or raise, see
        :meth:`_failed`); ``on_reply(rank, payload, num_replies)`` is called as each arrives."""
        replies: dict[int, Reply] = {}
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            pending = {self.conns[r]: r for r in self._live() if r not in replies}
            if not pending:
                return replies
            ready = wait(
                list(pending) + [self.procs[r].sentinel for r in pending.values()],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                now, ranks = time.monotonic(), sorted(pending.values())
                stopped = [r for r in ranks if now - self._beats[r].value >= STALE_S]
                if not stopped and now < start + PATIENCE * timeout_s:
                    deadline = min(start + PATIENCE * timeout_s, now + 1.0)  # (slow, but beating)
                    continue
                if stopped:
                    self._failed(
                        stopped,
                        f"workers {stopped} did not answer within {timeout_s:g}s (hung? their heartbeat stopped)",
                    )
                else:
                    self._failed(
                        ranks, f"workers {ranks} did not answer within {PATIENCE * timeout_s:g}s (still beating)"
                    )
                continue
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
                replies[rank] = (kind, payload)
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
        return self._settle(self._collect(self.step_timeout_s))

    def _regroup(self, members: list[int], rerun: bool) -> dict[int, Reply]:
        self._send_all({r: ("regroup", (members, rerun)) for r in self._live()})
        return self._collect(2 * self.step_timeout_s)  # (a new group, a new Buffer, maybe the step again)

    def _fail_all(self, why: str) -> NoReturn:
        self._abort()
        raise WorkerError(why)

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
