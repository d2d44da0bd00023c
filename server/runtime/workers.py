"""The driver's handle on the W workers, stepping them in lockstep: locally spawned processes (private pipes) or a
``torchrun`` job (rank 0 = driver + worker 0; each rank's plan goes to it alone over a gloo group: :mod:`.control`)."""

from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from .control import finish_sends, post_each, post_verdict, receive_each, send_each, wait_verdict
from .engine_config import EngineConfig
from .placement import bind_device
from .plan import StepPlan, StepResult
from .rendezvous import serve_loopback_store
from .worker import Worker
from .worker_loop import GroupChannel, StepFailed, serve_plans, worker_main

logger = logging.getLogger("server.engine")
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class WorkerError(RuntimeError):
    """A worker failed (its traceback is in the message) or stopped answering; all workers have been stopped."""


class WorkerGroup(abc.ABC):
    infos: list[dict]
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

            def ready(rank: int, info: dict, num_ready: int) -> None:
                logger.info("EP worker %d ready (%d/%d) after %.1f s: %d local experts, %.1f MiB of weights, KV cache "
                            "%d blocks (%.1f MiB) on %s", rank, num_ready, world_size, time.monotonic() - started,
                            info["num_local_experts"], info["weight_bytes"] / 2**20, info["num_kv_blocks"],
                            info["kv_cache_bytes"] / 2**20, info["device"])  # fmt: skip

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


def _init_torchrun(args: EngineConfig) -> tuple[int, int, Any, Worker, bool]:
    """Bind device ``LOCAL_RANK`` (install the NPU stand-in with ``simulate_npu``), set the socket interface
    variables (``args.socket_ifname``), join the torchrun job's default group on ``args.dist_backend`` (unless
    already joined: then its backend is the caller's), make the gloo control group, build the shard."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads_per_worker())
    device = bind_device(args.device, int(os.environ.get("LOCAL_RANK", "0")), args.simulate_npu)
    owns_group = not dist.is_initialized()
    if args.socket_ifname:  # read by gloo / HCCL / NCCL when they make their sockets: before any group exists
        for name in SOCKET_IFNAME_VARIABLES:
            os.environ[name] = args.socket_ifname
    if owns_group:
        dist.init_process_group(args.dist_backend, timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    return rank, world_size, control, Worker(args, rank, world_size, dist.group.WORLD, device), owns_group


class TorchrunWorkers(WorkerGroup):
    """Rank 0 of a ``torchrun`` job: this process is worker 0; ranks > 0 run :func:`run_worker_from_env`.

    Each step sends every live rank its plan and waits for its reply at most ``step_timeout_s`` (:mod:`.control`).
    A rank that fails, exits, is unreachable (its host died or its link is cut) or does not answer in time fails the
    group (:class:`WorkerError` naming it: the server answers 503 with the reason), or, with ``elastic``, is *lost*
    (as :class:`ProcessWorkers`'s: no more plans, None results; the Buffers, ``enable_shrink``, regroup without it)
    as long as rank 0 itself carries on. A lost rank is never taken back: rank 0 sends it nothing more and posts
    the verdict in the job's store, where a lost rank still running (hung, or cut off and reconnected) reads it
    once its step fails, and leaves. To rejoin, restart the job.
    """

    def __init__(self, args: EngineConfig) -> None:
        import torch.distributed as dist

        self.dist = dist
        rank, self.world_size, self.control, self.worker, self._owns_group = _init_torchrun(args)
        assert rank == 0, "TorchrunWorkers runs on rank 0; call run_worker_from_env() on the other ranks"
        self.store = dist.distributed_c10d._get_default_store()  # (torchrun's, on node 0)
        self.lost: dict[int, str] = {}
        self.overlaps = False  # rank 0 is worker 0: a step runs inside submit()
        self.step_timeout_s, self.elastic = args.step_timeout_s, False  # a failure while starting fails the group
        self._done: list[list[StepResult | None]] = []
        self._closed = self._released = False
        replies = self._exchange({}, args.dist_timeout_s)  # ("ready", info) from each rank's serve_plans
        self.infos = [self.worker.info] + [replies[r] for r in range(1, self.world_size)]
        self.elastic = args.elastic

    def _live(self) -> list[int]:
        return [r for r in range(1, self.world_size) if r not in self.lost]

    def _exchange(self, messages: dict[int, Any], timeout_s: float, local: Callable[[], Any] | None = None) -> dict:
        """Send ``messages`` (rank -> message), run ``local()`` meanwhile, and return every live rank's reply
        payload (``local``'s as rank 0's); ranks that failed are lost or fail the group (:meth:`_failed`)."""
        started = time.monotonic()
        posted, failed = post_each(self.control, messages)  # (not waited for: a cut-off rank would delay the step)
        replies: dict[int, Any] = {}
        own_error: Exception | None = None
        if local is not None:
            try:
                replies[0] = local()
            except Exception as e:  # noqa: BLE001 - rank 0 is the driver: its own step failing fails the group
                own_error = e  # (after the replies: a rank sending its error must find rank 0 listening)
        left = lambda: max(1.0, timeout_s - (time.monotonic() - started))  # noqa: E731 - a reply sent is taken
        failed |= finish_sends(posted, left())
        got, late = receive_each(self.control, [r for r in self._live() if r not in failed], left())
        failed |= late
        for r, (kind, payload) in got.items():
            if kind == "error":
                last = payload.strip().splitlines()[-1] if payload.strip() else "no traceback"
                failed[r] = f"rank {r} failed: {last}"  # (the traceback's last line: the error)
            else:
                replies[r] = payload
        if own_error is not None:
            self._stop()
            why = f"worker 0 failed: {type(own_error).__name__}: {str(own_error).splitlines()[0]}"
            raise WorkerError("; ".join([why, *(failed[r] for r in sorted(failed))])) from own_error
        if failed:
            self._failed(failed)
        return replies

    def _failed(self, failed: dict[int, str]) -> None:
        """The ranks of ``failed`` (rank -> why) failed: lose them (elastic) or stop the job and raise."""
        if not self.elastic:
            self._stop()
            raise WorkerError("; ".join(failed[r] for r in sorted(failed)))
        for rank in sorted(failed):
            logger.warning(
                "elastic: EP rank %d is lost (%s); serving continues on ranks %s without its experts",
                rank,
                failed[rank],
                [0, *(r for r in self._live() if r not in failed)],
            )
            self.lost[rank] = failed[rank]
        post_verdict(self.store, sorted(failed), "rank 0 declared it lost; restart the job to rejoin")

    def _stop(self) -> None:
        """Tell every live rank to stop: in the store (a rank whose step failed reads it there) and on the control
        group (bounded: a rank that cannot be told is left to its own failure)."""
        if not self._closed:
            self._closed = True
            post_verdict(self.store, self._live(), "")
            send_each(self.control, dict.fromkeys(self._live(), ("stop", None)), 1.0)

    def submit(self, plans: list[StepPlan]) -> None:
        if self._closed:
            raise WorkerError("the workers were shut down")
        messages = {r: ("step", plans[r]) for r in self._live()}
        replies = self._exchange(messages, self.step_timeout_s, lambda: self.worker.execute(plans[0]))
        self._done.append([replies.get(r) for r in range(self.world_size)])

    def collect(self) -> list[StepResult | None]:
        return self._done.pop(0)

    def is_alive(self) -> bool:
        return not self._closed

    def ping(self, timeout_s: float) -> None:
        """Not checked between steps: a hung or lost rank fails (or, elastic, is lost at) the next step."""
        if self._closed:
            raise WorkerError("the workers were shut down")

    def shutdown(self) -> None:
        if self._closed and self._released:
            return
        self._stop()
        self._released = True
        with contextlib.suppress(Exception):  # (its Buffers' teardown waits for peers that may be gone: bounded)
            self.worker.close()
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group(self.control)
        if self._owns_group:
            self.dist.destroy_process_group()


def run_worker_from_env(args: EngineConfig) -> None:
    """A ``torchrun`` rank > 0: check the placement, build the shard, run :func:`serve_plans` over the gloo control
    group (this rank's plan from rank 0 each step) until told to stop. After a failed step (reported to rank 0 if it
    can be) it waits for rank 0's verdict in the job's store: the job stops, or this rank was lost (it says so and
    leaves; a cut-off rank learns it once its link is back). Either way it exits 0 without tearing down (its peers
    may be gone; a non-zero exit would make torchrun stop its node's other ranks, rank 0 among them, which serves on
    or answers 503)."""
    import torch.distributed as dist

    args.check_placement()
    rank, _, control, worker, owns_group = _init_torchrun(args)
    try:
        serve_plans(worker, GroupChannel(control, 2 * args.step_timeout_s))  # (rank 0 waits one step timeout)
    except (StepFailed, RuntimeError):  # (RuntimeError: its connection to rank 0 failed)
        why = wait_verdict(dist.distributed_c10d._get_default_store(), rank)
        if why:
            print(f"EP rank {rank} leaves the job: {why}", file=sys.stderr, flush=True)
        os._exit(0)
    worker.close()
    dist.destroy_process_group(control)
    if owns_group:
        dist.destroy_process_group()
