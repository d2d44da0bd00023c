"""Run the server for a validated config: build the EP engine, wrap it in the app, serve it on uvicorn.

Local launch: this process drives the engine, which spawns ``ep-size`` worker processes. Under ``torchrun`` (the
multi-node launch, ``WORLD_SIZE`` set by torchrun) every process is one EP rank: rank 0 drives the engine and hosts
HTTP, the other ranks only run their worker loop. ``ep-size`` must then equal torchrun's world size.
"""

from __future__ import annotations

import os
import signal
import sys

from server.config import ServerConfig


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
    import uvicorn

    from server.api.app import create_app

    launch = torchrun_rank()
    if launch is not None:
        rank, world_size = launch
        if world_size != config.ep_size:
            print(f"error: ep-size: {config.ep_size} does not match torchrun's world size {world_size}",
                  file=sys.stderr)  # fmt: skip
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
        try:
            engine = build_engine(config)
        except (ValueError, FileNotFoundError) as e:  # the config is valid but the model / runtime refuse it
            print(f"error: cannot start the engine: {e}", file=sys.stderr)
            return 2
        try:
            app = create_app(config, engine)
            uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                        timeout_graceful_shutdown=5)  # fmt: skip
        finally:
            engine.shutdown()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
