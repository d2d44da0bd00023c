"""The EP decode runtime: lockstep workers, per-rank scheduling, sampling, the ``EngineCore`` and offline ``LLM``."""

from .engine import EPEngine
from .from_config import engine_from_config, run_torchrun_worker
from .llm import LLM, CompletionOutput, RequestOutput
from .worker import WorkerArgs
from .workers import WorkerError, run_worker_from_env

__all__ = [
    "LLM",
    "CompletionOutput",
    "EPEngine",
    "RequestOutput",
    "WorkerArgs",
    "WorkerError",
    "engine_from_config",
    "run_torchrun_worker",
    "run_worker_from_env",
]
