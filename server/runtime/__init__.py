"""The EP decode runtime: lockstep workers, per-rank scheduling, sampling, the ``EngineCore`` and offline ``LLM``."""

from .engine import EPEngine
from .engine_config import EngineConfig
from .from_config import engine_from_config, run_torchrun_worker
from .llm import LLM, CompletionOutput, RequestOutput
from .torchrun import run_worker_from_env
from .workers import WorkerError

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
