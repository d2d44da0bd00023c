"""The loop every worker runs, spawned or a torchrun rank: :func:`serve_plans` over a :class:`Channel` to the
driver: :class:`PipeChannel` (a private ``multiprocessing`` pipe; :func:`worker_main` is the process entry of a
spawned worker) or :class:`GroupChannel` (a torchrun job's gloo control group).
"""

from __future__ import annotations

import abc
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from server.checkpoint import CheckpointError
from server.runtime.engine_config import EngineConfig
from server.runtime.workers.control import receive_own, send_own
from server.runtime.workers.heartbeat import start_beating
from server.runtime.workers.placement import bind_device
from server.runtime.workers.rendezvous import init_loopback_group
from server.runtime.workers.worker import StepAborted, Worker


class Channel(abc.ABC):
    """A worker's end of its control channel to the driver. Messages are ``(kind, payload)``: from the driver
    ``("step", StepPlan)``, ``("regroup", (members, rerun))``, ``("ping", None)``, ``("stop", None)``; to it
    ``("ready", info)``, ``("ok", StepResult | None)``, ``("aborted", why)``, ``("pong", None)``, ``("error",
    traceback text)``."""

    @abc.abstractmethod
    def recv(self) -> tuple[str, Any]:
        """The driver's next message (``("stop", None)`` when the driver is gone)."""

    @abc.abstractmethod
    def send(self, kind: str, payload: Any) -> None: ...


class PipeChannel(Channel):
    """A spawned worker's private ``multiprocessing`` pipe. A reader thread takes the driver's messages off the
    pipe as they come, so a driver that sends step k+1 while this worker runs step k never blocks on a full pipe
    (nor, blocked there, leaves this worker's reply unread)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, name="plan-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):  # the driver is gone
                self._inbox.put(("stop", None))
                return
            self._inbox.put((kind, payload))
            if kind == "stop":
                return

    def recv(self) -> tuple[str, Any]:
        return self._inbox.get()

    def send(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))


class GroupChannel(Channel):
    """A torchrun rank > 0: rank 0 sends this rank its own plan over the gloo ``group``, this rank replies to rank 0
    alone, within ``reply_timeout_s``; while it waits for a plan it asks ``verdict()`` (rank 0's, in the store)
    whether it was lost (:mod:`.control`; :class:`~server.runtime.workers.torchrun.TorchrunWorkers` is the other
    end)."""

    def __init__(self, group: Any, reply_timeout_s: float, verdict: Callable[[], str | None]) -> None:
        self.group, self.reply_timeout_s, self.verdict = group, reply_timeout_s, verdict

    def recv(self) -> tuple[str, Any]:
        kind, payload = receive_own(self.group, lambda: self.verdict() or "")
        return kind, payload  # (a step's plan: this rank's alone)

    def send(self, kind: str, payload: Any) -> None:
        send_own(self.group, (kind, payload), self.reply_timeout_s)


class StepFailed(Exception):
    """A step raised; its traceback has been sent to the driver."""


def serve_plans(worker: Worker, channel: Channel) -> None:
    """The worker loop: report ready, then run each plan the driver sends until "stop". A step that a rank failure
    interrupts sends ``("aborted", why)`` and the loop waits for the driver's ``("regroup", (members, rerun))``
    (:meth:`Worker.regroup`); any other failing step sends ``("error", traceback)`` and raises :class:`StepFailed`."""
    channel.send("ready", worker.info)
    while True:
        kind, payload = channel.recv()
        if kind == "stop":
            return
        if kind == "ping":  # the driver's liveness probe
            channel.send("pong", None)
            continue
        try:
            result = worker.execute(payload) if kind == "step" else worker.regroup(*payload)
        except StepAborted as e:
            channel.send("aborted", str(e))
            continue
        except Exception as e:
            channel.send("error", f"worker {worker.rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
            raise StepFailed from e
        channel.send("ok", result)


def worker_main(rank: int, world_size: int, port: int, conn: Any, args: EngineConfig, beat: Any) -> None:
    """Process entry of a spawned worker: bind device ``rank`` (install the NPU stand-in with ``simulate_npu``),
    join the EP group (``args.dist_backend``), build the shard, :func:`serve_plans` over the pipe ``conn`` until
    "stop" or until the driver's end closes. Any exception is sent to the driver with its traceback. ``beat``: a
    shared double (``multiprocessing.Value``) its heartbeat thread keeps at the time (:mod:`.heartbeat`)."""
    import torch.distributed as dist

    torch.set_num_threads(args.threads_per_worker())
    start_beating(lambda _: setattr(beat, "value", time.monotonic()))
    channel = PipeChannel(conn)
    try:
        device = bind_device(args.device, rank, args.simulate_npu)
        if args.needs_group(world_size):
            init_loopback_group(rank, world_size, port, args.dist_timeout_s, args.dist_backend)
        worker = Worker(args, rank, world_size, dist.group.WORLD if dist.is_initialized() else None, device)
        serve_plans(worker, channel)
        worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except StepFailed:  # reported by serve_plans
        os._exit(1)  # peers may be blocked in a collective with us: no group teardown
    except CheckpointError as e:  # a fault of the checkpoint (a NaN weight, ...): its one line, no traceback
        try:
            channel.send("error", f"worker {rank}: {e}")
        finally:
            os._exit(1)
    except BaseException:  # noqa: BLE001 - forwarded to the driver with the traceback, then this process exits
        try:
            channel.send("error", f"worker {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
        finally:
            os._exit(1)  # peers may be blocked in a collective with us: no group teardown
