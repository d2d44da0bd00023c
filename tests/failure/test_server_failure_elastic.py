"""Elastic mode (``--elastic``): a worker that dies (SIGKILL) or hangs (SIGSTOP) mid-stream is lost, the survivor
keeps serving. The request that ran on the lost worker ends with an error naming it; the one on the survivor
finishes in full (also when worker 0 is lost: the rendezvous store lives in the driver); ``/health`` stays 200;
the loss is metered; and a new request's greedy tokens equal an independent single-process oracle (every expert
local, no Buffer) in which the lost worker's experts contribute nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch

from server.engine_api import SamplingParams
from server.runtime import EngineConfig
from server.runtime.workers.worker import PlanEntry, StepPlan, Worker
from tests.support.serving import greedy, stream_completion
from tests.support.tiny_moe import TINY_MODEL, real_server

STEP_TIMEOUT_S = 6.0  # the Buffers' collective timeout is a third of it
PROMPT = [7, 3, 9, 1]
LONG = greedy([1, 2, 3], 400)


def oracle_greedy(prompt: list[int], num_tokens: int, dropped_experts: set[int]) -> list[int]:
    """Greedy tokens of the tiny model on one process (LocalComm: every expert local), with the experts in
    ``dropped_experts`` removed from every token's top-k (their weight is not renormalised: DeepEP's reference)."""
    worker = Worker(EngineConfig(random_model=TINY_MODEL, max_num_seqs=4, max_model_len=512), 0, 1)
    comm = worker.model.comm
    plain_dispatch = comm.dispatch
    dropped = torch.tensor(sorted(dropped_experts), dtype=torch.int64)

    def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_tokens_all_ranks: int | None = None):  # noqa: ANN202
        return plain_dispatch(x, topk_idx.masked_fill(torch.isin(topk_idx, dropped), -1), num_tokens_all_ranks)

    comm.dispatch = dispatch
    params = SamplingParams(max_tokens=num_tokens, temperature=0)
    blocks = list(range(-(-512 // worker.cache.block_size)))  # one full-length request's blocks
    out = worker.execute(StepPlan([PlanEntry(0, 0, list(prompt), True, params, blocks, True)])).token_ids
    while len(out) < num_tokens:
        out += worker.execute(StepPlan([PlanEntry(0, len(prompt) + len(out) - 1, [out[-1]], True)])).token_ids
    return out


@pytest.mark.parametrize(("sig", "lost"), [(signal.SIGKILL, 1), (signal.SIGSTOP, 1), (signal.SIGKILL, 0)])
def test_elastic_mode_keeps_serving_on_the_survivor(sig: int, lost: int) -> None:
    with real_server(**{"elastic": True, "step-timeout-s": STEP_TIMEOUT_S}) as srv:
        on_rank0, on_rank1 = {"first": threading.Event()}, {"first": threading.Event()}
        threads = []
        for out in (on_rank0, on_rank1):  # least-loaded placement: the first goes to worker 0, the second to 1
            threads.append(threading.Thread(target=stream_completion, args=(srv.url, LONG, out)))
            threads[-1].start()
            assert out["first"].wait(30)
        on_lost, on_survivor = (on_rank1, on_rank0) if lost == 1 else (on_rank0, on_rank1)
        os.kill(srv.worker_pids[lost], sig)
        lost_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        took = time.monotonic() - lost_at
        assert on_lost["error"] is not None and f"EP worker {lost} was lost" in on_lost["error"]["message"], on_lost
        assert on_lost["finish"] is None and on_lost["tokens"] < 400
        survivor = (on_survivor["tokens"], on_survivor["finish"], on_survivor["done"], on_survivor["error"])
        assert survivor == (400, "length", True, None), on_survivor
        assert took < STEP_TIMEOUT_S + 10
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert 'deep_ep_npu:ep_ranks_lost{model_name="random-qwen3-moe"} 1.0' in c.get("/metrics").text
            body = greedy(PROMPT, 8)
            token_ids = [c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2)]
        assert not srv.engine.workers.procs[lost].is_alive() and srv.engine.workers.procs[1 - lost].is_alive()
    masked = oracle_greedy(PROMPT, 8, dropped_experts={2 * lost, 2 * lost + 1})  # 4 experts, 2 per worker
    assert token_ids == [masked, masked]
    assert masked != oracle_greedy(PROMPT, 8, dropped_experts=set())  # the oracle tells the two apart
