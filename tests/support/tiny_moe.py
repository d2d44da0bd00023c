"""A tiny random Qwen3-MoE for the serving tests: its configuration, the app over a real EP engine serving it, its
greedy tokens on one process with every expert local (the independent oracle), and a greedy request's body."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from server.api import create_app
from server.api.serve import build_engine
from server.config import build_config
from server.engine_api import SamplingParams
from server.runtime import EngineConfig
from server.runtime.workers.worker import PlanEntry, StepPlan, Worker
from tests.support.serving import UvicornThread

STEP_TIMEOUT_S = 2.0  # real_server's step timeout
PROMPT = [7, 3, 9, 1]


def qwen3_moe(num_hidden_layers: int = 2, num_experts: int = 8, num_experts_per_tok: int = 2, **more: object) -> dict:
    """``--random-model`` of a Qwen3-MoE with hidden size 32, 2 heads (1 KV head, 16 wide), experts 16 wide, a
    vocabulary of 256, and ``more``."""
    return {
        "architecture": "qwen3_moe",
        "hidden_size": 32,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "moe_intermediate_size": 16,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "vocab_size": 256,
        **more,
    }


TINY_MODEL = qwen3_moe(num_hidden_layers=1, num_experts=4)  # real_server's model
MODEL = qwen3_moe()  # the EPLB and elastic tests' model (8 experts, 2 layers)


@contextlib.contextmanager
def real_server(**options: object) -> Iterator[UvicornThread]:
    """The app over a real 2-worker EP engine serving :data:`TINY_MODEL` (``options`` override the CLI values);
    ``srv.engine`` is the EPEngine, ``srv.worker_pids`` its workers' pids."""
    values = {
        "ep-size": 2,
        "backend": "reference",
        "random-model": TINY_MODEL,
        "max-num-seqs": 4,
        "max-model-len": 512,
        "step-timeout-s": STEP_TIMEOUT_S,
        "log-level": "warning",
        **options,
    }
    config = build_config(values)
    engine = build_engine(config)
    pids = [p.pid for p in engine.workers.procs]
    try:
        with UvicornThread(create_app(config, engine)) as srv:
            srv.engine = engine
            srv.worker_pids = pids
            yield srv
    finally:
        engine.shutdown()
        for pid in pids:  # a test that stopped a worker must not leave it stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def oracle_greedy(prompt: list[int], num_tokens: int, model: dict = MODEL) -> list[int]:
    """Greedy tokens of ``model`` on one process, every expert local."""
    worker = Worker(EngineConfig(random_model=model, max_num_seqs=4, max_model_len=512), 0, 1)
    params = SamplingParams(max_tokens=num_tokens, temperature=0)
    blocks = list(range(-(-512 // worker.cache.block_size)))
    out = worker.execute(StepPlan([PlanEntry(0, 0, list(prompt), True, params, blocks, True)])).token_ids
    while len(out) < num_tokens:
        out += worker.execute(StepPlan([PlanEntry(0, len(prompt) + len(out) - 1, [out[-1]], True)])).token_ids
    return out
