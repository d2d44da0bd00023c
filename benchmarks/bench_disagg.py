"""Inter-token latency of decoding streams while long prompts arrive: disaggregated (a prefill instance at EP 1, a
decode instance at EP 2, the router; KV moved by Mooncake over loopback TCP) against one colocated EP 2 server, in
the same run, on the same random model.

Per mode: ``--streams`` greedy streams of ``--stream-tokens`` tokens start with short prompts; once they decode,
``--prompts`` requests of ``--prompt-len`` tokens arrive, one every ``--gap`` seconds (one output token each). The
inter-token latency is the client-side time between a stream's consecutive token chunks; p50 / p99 over all
streams. Colocated, every step of the streams carries the long prompts' chunks (``--max-num-batched-tokens``);
disaggregated, the decode instance's steps hold decodes only. Informational: on one small machine both instances
share the same cores.

    .venv/bin/python benchmarks/bench_disagg.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from server.api import create_app  # noqa: E402
from server.api.serve import build_engine  # noqa: E402
from server.config import build_config  # noqa: E402
from server.router import Pool, create_router_app  # noqa: E402
from tests.support.serving import UvicornThread  # noqa: E402

MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "moe_intermediate_size": 128,
}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, gaps: list[float], started: asyncio.Event) -> None:
    last = None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if not event["choices"][0].get("token_ids"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
                started.set()
            last = now


async def _measure(url: str, args: argparse.Namespace) -> list[float]:
    gaps: list[float] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [
            asyncio.ensure_future(
                _stream(
                    client,
                    url,
                    {
                        "prompt": [3 + i, 5, 7, 11],
                        "max_tokens": args.stream_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                    gaps,
                    started,
                )
            )
            for i in range(args.streams)
        ]
        await started.wait()
        prompts = []
        for i in range(args.prompts):
            prompt = [(i * 37 + j * 11) % 250 + 1 for j in range(args.prompt_len)]
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            prompts.append(asyncio.ensure_future(client.post(url + "/v1/completions", json=body)))
            await asyncio.sleep(args.gap)
        for r in await asyncio.gather(*prompts):
            assert r.status_code == 200, r.text
        await asyncio.gather(*streams)
    return gaps


def _serve(configs: dict, run) -> list[float]:  # noqa: ANN001
    engines = {name: build_engine(config) for name, config in configs.items()}
    servers = [UvicornThread(create_app(configs[name], engines[name])) for name in configs]
    for server in servers:
        server.__enter__()
    try:
        return run([s.url for s in servers])
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--gap", type=float, default=0.4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = parser.parse_args()
    base = {
        "random-model": MODEL,
        "max-num-seqs": 16,
        "max-model-len": 1100,
        "kv-cache-memory": "256M",
        "max-num-batched-tokens": args.max_num_batched_tokens,
        "log-level": "warning",
    }
    results = {}
    results["colocated (EP 2)"] = _serve(
        {"c": build_config({**base, "ep-size": 2})}, lambda urls: asyncio.run(_measure(urls[0], args))
    )

    def disaggregated(urls: list[str]) -> list[float]:
        router = create_router_app(Pool("prefill", [urls[0]], "round-robin"), Pool("decode", [urls[1]], "round-robin"))
        with UvicornThread(router) as r:
            return asyncio.run(_measure(r.url, args))

    configs = {
        "p": build_config({**base, "ep-size": 1, "disaggregation-mode": "prefill", "disaggregation-bootstrap-port": 0}),
        "d": build_config({**base, "ep-size": 2, "disaggregation-mode": "decode"}),
    }
    results["disaggregated (P EP 1 + D EP 2)"] = _serve(configs, disaggregated)
    print(
        f"{args.streams} streams x {args.stream_tokens} tokens while {args.prompts} prompts of {args.prompt_len} "
        f"tokens arrive every {args.gap}s (max-num-batched-tokens {args.max_num_batched_tokens}):"
    )
    for name, gaps in results.items():
        q = statistics.quantiles(gaps, n=100)
        print(
            f"  {name:34s} ITL p50 {1e3 * statistics.median(gaps):7.1f} ms   p99 {1e3 * q[98]:7.1f} ms   "
            f"({len(gaps)} gaps)"
        )


if __name__ == "__main__":
    main()
