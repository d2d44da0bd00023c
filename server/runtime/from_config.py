"""Build the runtime from the server's validated ``ServerConfig`` (``server/config.py``)."""

from __future__ import annotations

from typing import Any

from .engine import EPEngine, default_capacity
from .worker import WorkerArgs
from .workers import run_worker_from_env


def _check(config: Any) -> None:
    if getattr(config, "dist_backend", "gloo") != "gloo":
        raise ValueError(f"dist-backend: {config.dist_backend!r} is not supported by the CPU runtime; use 'gloo'")


def engine_from_config(config: Any) -> EPEngine:
    """Start the engine (local workers, or rank 0 of a torchrun job) for a ``ServerConfig``."""
    _check(config)
    return EPEngine(
        model=config.model,
        ep_size=config.ep_size,
        dtype=config.dtype,
        backend=config.backend,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        seed=config.seed,
        random_model=dict(config.random_model) or None,
        step_timeout_s=getattr(config, "step_timeout_s", 30.0),
        elastic=getattr(config, "elastic", False),
        moe_impl=getattr(config, "moe_impl", "unfused"),
    )


def run_torchrun_worker(config: Any) -> None:
    """The worker loop of a torchrun rank > 0 for a ``ServerConfig`` (returns when rank 0 shuts down)."""
    _check(config)
    run_worker_from_env(
        WorkerArgs(
            model=config.model,
            dtype=config.dtype,
            backend=config.backend,
            seed=config.seed,
            random_model=dict(config.random_model) or None,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_max_dispatch_tokens_per_rank=default_capacity(config.max_num_seqs),
            moe_impl=getattr(config, "moe_impl", "unfused"),
        )
    )
