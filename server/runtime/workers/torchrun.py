"""A ``torchrun`` job's workers: rank 0 drives the engine and is worker 0 (:class:`TorchrunWorkers`), the other ranks
run :func:`run_worker_from_env`; each rank's plan goes to it alone over a gloo control group (:mod:`.control`)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from server.runtime.engine_config import EngineConfig
from server.runtime.scheduling.plan import StepPlan, StepResult
from server.runtime.workers.control import finish_sends, post_each, receive_each, send_each
from server.runtime.workers.group import Reply, WorkerError, WorkerGroup
from server.runtime.workers.heartbeat import PATIENCE, Pulse, start_beating
from server.runtime.workers.job_store import StoreLink, beat_in, post_verdict, read_beat, read_verdict, wait_verdict
from server.runtime.workers.placement import bind_device
from server.runtime.workers.worker import StepAborted, Worker
from server.runtime.workers.worker_loop import GroupChannel, StepFailed, serve_plans

logger = logging.getLogger("server.engine")
STORE_CALL_S = 2.0
"""Each heartbeat or verdict call on the job's store gives up after this long (and reconnects next time)."""
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


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
    (as :class:`ProcessWorkers`'s: no more plans, None results; the others regroup without it at that step boundary,
    :meth:`WorkerGroup._settle`) as long as rank 0 itself carries on. A lost rank is never taken back: rank 0 sends
    it nothing more and posts the verdict in the job's store, where a lost rank still running (hung, or cut off and
    reconnected) reads it once its step fails, and leaves. To rejoin, restart the job.
    """

    def __init__(self, args: EngineConfig) -> None:
        import torch.distributed as dist

        self.dist = dist
        rank, self.world_size, self.control, self.worker, self._owns_group = _init_torchrun(args)
        assert rank == 0, "TorchrunWorkers runs on rank 0; call run_worker_from_env() on the other ranks"
        self.store = StoreLink(dist.distributed_c10d._get_default_store(), STORE_CALL_S)  # (torchrun's, on node 0)
        self._pulse = Pulse(lambda r: read_beat(self.store, r))
        self.lost: dict[int, str] = {}
        self.overlaps = False  # rank 0 is worker 0: a step runs inside submit()
        self.step_timeout_s, self.elastic = args.step_timeout_s, False  # a failure while starting fails the group
        self._done: list[list[StepResult | None]] = []
        self._closed = self._released = False
        replies = self._exchange({}, args.dist_timeout_s)  # ("ready", info) from each rank's serve_plans
        self.infos = [self.worker.info] + [replies[r][1] for r in range(1, self.world_size)]
        self.elastic = args.elastic

    def _live(self) -> list[int]:
        return [r for r in range(1, self.world_size) if r not in self.lost]

    def _exchange(self, messages: dict[int, Any], timeout_s: float, local: Callable[[], Any] | None = None) -> dict:
        """Send ``messages`` (rank -> message), run ``local()`` meanwhile, and return every live rank's reply
        ``(kind, payload)`` (``local``'s as rank 0's: ``("aborted", why)`` if it raised :class:`StepAborted`); ranks
        that failed are lost or fail the group (:meth:`_failed`)."""
        started = time.monotonic()
        posted, failed = post_each(self.control, messages)  # (not waited for: a cut-off rank would delay the step)
        replies: dict[int, Any] = {}
        own_error: Exception | None = None
        if local is not None:
            try:
                replies[0] = ("ok", local())
            except StepAborted as e:
                replies[0] = ("aborted", str(e))
            except Exception as e:  # noqa: BLE001 - rank 0 is the driver: its own step failing fails the group
                own_error = e  # (after the replies: a rank sending its error must find rank 0 listening)
        left = lambda: max(1.0, timeout_s - (time.monotonic() - started))  # noqa: E731 - a reply sent is taken
        failed |= finish_sends(posted, left())
        got, late = receive_each(
            self.control, [r for r in self._live() if r not in failed], left(), self._pulse.beating
        )
        failed |= late
        for r, (kind, payload) in got.items():
            if kind == "error":
                last = payload.strip().splitlines()[-1] if payload.strip() else "no traceback"
                failed[r] = f"rank {r} failed: {last}"  # (the traceback's last line: the error)
            else:
                replies[r] = (kind, payload)
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
        self._done.append(self._settle(replies))

    def _regroup(self, members: list[int], rerun: bool) -> dict[int, Reply]:
        messages = {r: ("regroup", (members, rerun)) for r in self._live()}
        # (a new group, a new Buffer, maybe the step again: up to twice a step's bound)
        return self._exchange(messages, 2 * self.step_timeout_s, lambda: self.worker.regroup(members, rerun))

    def _fail_all(self, why: str) -> NoReturn:
        self._stop()
        raise WorkerError(why)

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
    store = dist.distributed_c10d._get_default_store()
    stop_beating = start_beating(beat_in(StoreLink(store, STORE_CALL_S), rank))
    verdicts = StoreLink(store, STORE_CALL_S)
    # (replies bounded by what rank 0 waits at most: a regroup's 2 x the step timeout, as long as this rank beats)
    channel = GroupChannel(control, 2 * PATIENCE * args.step_timeout_s, lambda: read_verdict(verdicts, rank))
    try:
        serve_plans(worker, channel)
    except (StepFailed, RuntimeError):  # (RuntimeError: its connection to rank 0 failed, or it was lost meanwhile)
        why = wait_verdict(verdicts, rank)
        if why:
            print(f"EP rank {rank} leaves the job: {why}", file=sys.stderr, flush=True)
        os._exit(0)
    stop_beating()
    worker.close()
    dist.destroy_process_group(control)
    if owns_group:
        dist.destroy_process_group()
