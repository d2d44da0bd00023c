"""Build the runtime from the server's validated ``ServerConfig`` (``server/config.py``): both entry points make the
one :class:`~server.runtime.engine_config.EngineConfig` the driver and every worker take."""

from __future__ import annotations

from typing import Any

from server.runtime.decode_engine import DecodeEngine
from server.runtime.engine import EPEngine
from server.runtime.engine_config import EngineConfig
from server.runtime.prefill_engine import PrefillEngine
from server.runtime.workers.torchrun import run_worker_from_env


def engine_from_config(config: Any) -> EPEngine:
    """Start the engine (local workers, or rank 0 of a torchrun job) for a ``ServerConfig``: a prefill or decode
    instance's under ``disaggregation-mode``."""
    engine_config = EngineConfig.from_server_config(config)
    if engine_config.disaggregation_mode == "prefill":
        return PrefillEngine(engine_config)
    if engine_config.disaggregation_mode == "decode":
        return DecodeEngine(engine_config)
    return EPEngine(engine_config)


def run_torchrun_worker(config: Any) -> None:
    """The worker loop of a torchrun rank > 0 for a ``ServerConfig`` (returns when rank 0 shuts down)."""
    run_worker_from_env(EngineConfig.from_server_config(config, launch="torchrun"))
