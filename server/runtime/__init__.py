"""The EP decode runtime: lockstep workers, per-rank scheduling, sampling, the ``EngineCore`` and offline ``LLM``."""

from server.runtime.engine import EPEngine
from server.runtime.engine_config import EngineConfig
from server.runtime.from_config import engine_from_config, run_torchrun_worker
from server.runtime.llm import LLM, CompletionOutput, RequestOutput
from server.runtime.workers.group import WorkerError
from server.runtime.workers.torchrun import run_worker_from_env

__all__ = [
    "LLM",
    "CompletionOutput",
    "EPEngine",
    "EngineConfig",
    "RequestOutput",
    "WorkerError",
    "engine_from_config",
    "run_torchrun_worker",
    "run_worker_from_env",
]
