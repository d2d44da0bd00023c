"""Run the server for a validated config: build the EP engine, wrap it in the app, serve it on uvicorn.

Local launch: this process drives the engine, which spawns ``ep-size`` worker processes. Under ``torchrun`` (the
multi-node launch, ``WORLD_SIZE`` set by torchrun) every process is one EP rank: rank 0 drives the engine and hosts
HTTP, the other ranks only run their worker loop. ``ep-size`` must then equal torchrun's world size.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

import uvicorn

from server.config import ServerConfig

logger = logging.getLogger("server.serve")


def build_engine(config: ServerConfig):  # noqa: ANN201 - an EngineCore; the runtime is imported lazily
    """Start the EP runtime described by ``config`` (spawns the local workers)."""
    from server.runtime import engine_from_config

    return engine_from_config(config)


def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when launched by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def serve(config: ServerConfig) -> int:
    """Serve until SIGINT / SIGTERM; returns the process exit code."""
    from server.api.app import create_app

    configure_logging(config.log_level)
    launch = torchrun_rank()
    if launch is not None:
        rank, world_size = launch
        if world_size != config.ep_size:
            print(
                f"error: ep-size: {config.ep_size} does not match torchrun's world size {world_size}", file=sys.stderr
            )
            return 2
        if rank != 0:
            from server.runtime import run_torchrun_worker

            try:
                run_torchrun_worker(config)
            except ValueError as e:  # e.g. the engine config or this machine's devices refuse it (a non-zero exit)
                print(f"error: rank {rank} cannot start: {e}", file=sys.stderr)
                return 2
            return 0
    # SIGTERM exits cleanly (code 0, workers shut down) while the model loads, and after uvicorn's graceful
    # shutdown too: uvicorn re-raises the signal it caught with the handler it found, i.e. this one
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        logger.info(
            "config resolved: model %s (%s), ep-size %d, device %s, backend %s, dtype %s, max-num-seqs %d "
            "per worker, max-model-len %d",
            config.model_name,
            config.model or "random weights",
            config.ep_size,
            config.device,
            config.backend,
            config.dtype,
            config.max_num_seqs,
            config.max_model_len,
        )
        from server.runtime.workers.group import WorkerError

        try:
            engine = build_engine(config)
        except (ValueError, FileNotFoundError, WorkerError) as e:  # the model / runtime refuse a valid config
            print(f"error: cannot start the engine: {e}", file=sys.stderr)
            return 2
        try:
            app = create_app(config, engine)
            uv_config = uvicorn.Config(
                app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5
            )
            _AnnouncingServer(uv_config, _serving_line(config, engine)).run()
        finally:
            engine.shutdown()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serving_line(config: ServerConfig, engine: object) -> str:
    """``serving MODEL on URL (EP n, backend, device)``: {url} is filled in once uvicorn has bound its socket."""
    infos = getattr(engine, "worker_infos", None)  # (an engine without workers, e.g. a test's, has none)
    backend, device = (infos[0].moe_backend, infos[0].device) if infos else (config.backend, config.device)
    return f"serving {config.model_name} on {{url}} (EP {config.ep_size}, backend {backend}, device {device})"


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's server, which logs ``line`` (``{url}`` filled in) once it listens, after its own start-up lines."""

    def __init__(self, config: uvicorn.Config, line: str) -> None:
        super().__init__(config)
        self.line = line

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        bound = [sock.getsockname() for server in self.servers for sock in server.sockets]
        if self.started and bound:
            host, port = bound[0][:2]
            logger.info(self.line.format(url=f"http://{host}:{port}"))


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname + ':':<10}{super().format(record)}"  # uvicorn's layout: "INFO:     ..."


def configure_logging(level: str) -> None:
    """The ``server`` loggers (start-up phases, warnings about requests) print to stderr as uvicorn's do."""
    log = logging.getLogger("server")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def leave_torchrun_rank(code: int) -> NoReturn:
    """End a torchrun rank's process once :func:`serve` has shut everything down, without the interpreter's
    finalization: control sends and receives a lost peer never completed are left pending by design (gloo's own
    timeout would close every connection of the group), and a daemon thread still inside such a wait while the
    interpreter tears down the C++ objects under it aborts the process (``terminate called without an active
    exception``, SIGABRT), which torchrun reports as a failed job."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
