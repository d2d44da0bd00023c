"""The paged KV cache under the real runtime (2 spawned workers) on real uvicorn, with the ``openai`` client.

- A budget that holds 4 full-length requests per worker serves 32 concurrent full-length requests: all complete,
  each with the greedy tokens of the same request run alone (oracle: one request at a time, EP 1, no prefix
  caching), preemption happens and ``/metrics`` counts it.
- A budget under one full-length request fails at start-up, saying what fits and what was asked: from the
  ``kv-cache-memory`` option (before any worker starts, also on the command line) and from the memory fraction
  (after the workers measured it).
- A second request sharing a 256-token prefix with a finished one finds it cached: the hits in ``/metrics``, the
  same tokens as without prefix caching.
- Async scheduling (step k+1 planned while step k runs) gives the same tokens, text and log-probabilities as
  planning after each step, with seeded sampling, penalties, stop strings and EOS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch

from server import LLM, SamplingParams
from server.loader import random_hf_config
from server.models import ModelConfig
from server.models.kv_cache import bytes_per_block
from tests.support.tiny_moe import real_server

MAX_LEN, BLOCK = 96, 16
PER_REQUEST = bytes_per_block(ModelConfig.from_hf(random_hf_config()), BLOCK, torch.float32) * (MAX_LEN // BLOCK)
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.yaml")
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^deep_ep_npu:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def alone(prompts: list[list[int]], max_tokens: list[int], max_model_len: int) -> list[list[int]]:
    """Each request's greedy tokens on its own (one request in the engine at a time, no prefix cache)."""
    with LLM(ep_size=1, max_model_len=max_model_len, enable_prefix_caching=False) as llm:
        return [
            llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
            for p, n in zip(prompts, max_tokens, strict=True)
        ]


def test_budget_of_four_requests_serves_32_concurrent_long_requests() -> None:
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(20 + i)] for i in range(32)]
    max_tokens = [MAX_LEN - len(p) for p in prompts]  # each request runs to max-model-len
    options = {
        "kv-cache-memory": 4 * PER_REQUEST,
        "block-size": BLOCK,
        "max-model-len": MAX_LEN,
        "max-num-seqs": 16,
        "max-num-batched-tokens": 64,
        "random-model": {},
    }
    with real_server(**options) as srv:
        assert [i.num_kv_blocks for i in srv.engine.worker_infos] == [4 * MAX_LEN // BLOCK] * 2
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        served: dict[int, list[int]] = {}

        def run(i: int) -> None:
            r = client.completions.create(
                model="random-qwen3-moe", prompt=prompts[i], max_tokens=max_tokens[i], **GREEDY
            )
            assert r.choices[0].finish_reason == "length"
            served[i] = r.choices[0].model_extra["token_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        text = httpx.get(srv.url + "/metrics").text
    assert sorted(served) == list(range(32))
    assert metric(text, "num_preemptions_total") > 0
    assert metric(text, "kv_cache_usage_perc") == 0.0  # all done: every block released
    assert [served[i] for i in range(32)] == alone(prompts, max_tokens, MAX_LEN)


def test_budget_under_one_request_fails_at_start_up() -> None:
    too_small = PER_REQUEST - 1
    want = (
        rf"KV cache too small: kv-cache-memory .* holds {MAX_LEN // BLOCK - 1} blocks of {BLOCK} tokens .*; one "
        rf"request of max-model-len {MAX_LEN} needs {MAX_LEN // BLOCK} blocks"
    )
    with pytest.raises(ValueError, match=want):
        LLM(kv_cache_memory=too_small, max_model_len=MAX_LEN, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"KV cache too small: worker 0's budget \(gpu-memory-utilization 1e-12 of"):
        LLM(gpu_memory_utilization=1e-12, max_model_len=MAX_LEN)  # measured by the workers, refused by the driver
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--config",
            DEFAULT_CONFIG,
            "--port",
            "0",
            "--kv-cache-memory",
            "1K",
            "--max-model-len",
            str(MAX_LEN),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2
    assert re.search(
        r"error: cannot start the engine: KV cache too small: kv-cache-memory 0\.0 MiB holds 0 blocks", cli.stderr
    ), cli.stderr


def test_prefix_cache_hits_give_the_same_tokens() -> None:
    prefix = [(5 * j) % 250 + 1 for j in range(256)]  # 16 full blocks
    prompts = [prefix + [9, 8, 7, 6], prefix + [1, 2, 3]]
    with real_server(**{"block-size": BLOCK, "random-model": {}}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        served = [
            client.completions.create(model="random-qwen3-moe", prompt=p, max_tokens=12, **GREEDY)
            .choices[0]
            .model_extra["token_ids"]
            for p in prompts
        ]
        text = httpx.get(srv.url + "/metrics").text
    assert metric(text, "prefix_cache_queries_total") == sum(len(p) for p in prompts)
    assert metric(text, "prefix_cache_hits_total") == len(prefix)  # the second request's whole shared prefix
    assert served == alone(prompts, [12, 12], 512)


def test_async_scheduling_changes_nothing() -> None:
    prompts = [[3, 1, 4, 1, 5], list(range(10, 90)), [2, 7, 1, 8] * 5, [6]]
    params = [
        SamplingParams(max_tokens=30, temperature=0.9, seed=7, frequency_penalty=0.5, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, stop=["\x10"], presence_penalty=1.0),
        SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=3, prompt_logprobs=1),
        SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[65], repetition_penalty=1.3),
    ]
    results = []
    for async_scheduling in (True, False):
        with LLM(ep_size=2, max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=async_scheduling) as llm:
            outs = llm.generate(prompts, params)
        results.append(
            [
                (
                    o.outputs[0].token_ids,
                    o.outputs[0].text,
                    o.outputs[0].finish_reason,
                    o.outputs[0].logprobs,
                    o.prompt_logprobs,
                )
                for o in outs
            ]
        )
    assert results[0] == results[1]
