"""Serving benchmark in the style of ``vllm bench serve``: random token-id prompts against an OpenAI endpoint.

Load: Poisson arrivals (``--request-rate``, default inf = all at once) capped by ``--max-concurrency``. Reports
request / output / total token throughput and TTFT, TPOT, ITL, E2EL (mean, p50, p90, p99, in ms), as vLLM defines
them: TTFT to the first streamed token, TPOT = (E2EL - TTFT) / (output tokens - 1) per request, ITL = every gap
between streamed chunks pooled over requests. Also reads the server's ``/metrics`` before and after the run, so the
runtime's own mean step time (``engine_step_seconds``) is measured in the same run: ``overhead = 1 - step / TPOT``
is the share of TPOT spent in HTTP, streaming and scheduling.

Either point it at a running server (``--base-url``) or let it launch ``python -m server`` per EP size
(``--launch-config configs/default.yaml --ep-sizes 1,2``), which also gives the EP 1 vs EP 2 comparison.

    python benchmarks/bench_serving.py --launch-config configs/default.yaml --ep-sizes 1,2 \\
        --num-prompts 64 --max-concurrency 16 --random-input-len 32 --random-output-len 32 --save-result out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np

STEP = "deep_ep_npu:engine_step_seconds"
ITL = "deep_ep_npu:inter_token_latency_seconds"
TOKEN_STEP = "deep_ep_npu:token_step_seconds"


def _metric_sums(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(tuple(f"{m}_{s}" for m in (STEP, ITL, TOKEN_STEP) for s in ("sum", "count"))):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def _mean_delta(before: dict, after: dict, name: str) -> tuple[float, float]:
    """(count, mean) of a histogram over the run, from its _sum and _count before and after."""
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
    return count, (total / count if count else float("nan"))


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, args: Any) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft, chunk_times, usage, error = None, [], None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("error"):
                        error = chunk["error"]["message"]
                    if chunk.get("choices"):
                        ttft = ttft if ttft is not None else now - start
                        chunk_times.append(now)
    except httpx.HTTPError as e:
        error = repr(e)
    latency = time.perf_counter() - start
    output_tokens = usage["completion_tokens"] if usage else 0
    return {"ok": error is None and usage is not None, "error": error, "ttft": ttft, "latency": latency,
            "output_tokens": output_tokens, "prompt_tokens": len(prompt),
            "itl": list(np.diff(chunk_times)) if len(chunk_times) > 1 else []}  # fmt: skip


def _stats(values: list[float], percentiles: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in percentiles}}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in percentiles}}


async def run_load(base_url: str, args: Any) -> dict:
    rng = random.Random(args.seed)
    lo = max(1, int(args.random_input_len * (1 - args.random_range_ratio)))
    olo = max(1, int(args.random_output_len * (1 - args.random_range_ratio)))
    requests = [([rng.randrange(args.vocab) for _ in range(rng.randint(lo, args.random_input_len))],
                 rng.randint(olo, args.random_output_len)) for _ in range(args.num_prompts)]  # fmt: skip
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for prompt, out_len in requests[: args.num_warmups]:
            await _one(client, model, prompt, out_len, args)
        before = _metric_sums((await client.get("/metrics")).text)
        sem = asyncio.Semaphore(args.max_concurrency)

        async def limited(prompt: list[int], out_len: int) -> dict:
            async with sem:
                return await _one(client, model, prompt, out_len, args)

        tasks = []
        start = time.perf_counter()
        for prompt, out_len in requests:
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = _metric_sums((await client.get("/metrics")).text)
    return summarize(results, duration, before, after, args)


def summarize(results: list[dict], duration: float, before: dict, after: dict, args: Any) -> dict:
    pct = [int(p) for p in args.percentiles.split(",")]
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    tpots = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    steps, step_s = _mean_delta(before, after, STEP)
    _, server_itl_s = _mean_delta(before, after, ITL)
    _, token_step_s = _mean_delta(before, after, TOKEN_STEP)
    tpot = _stats(tpots, pct)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({str(r["error"]) for r in results if not r["ok"]})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r["ttft"] for r in ok], pct), "tpot_ms": tpot,
        "itl_ms": _stats([g for r in ok for g in r["itl"]], pct), "e2el_ms": _stats([r["latency"] for r in ok], pct),
        "engine_steps": steps, "engine_step_ms": step_s * 1000.0, "engine_busy_fraction": steps * step_s / duration,
        "server_itl_ms": server_itl_s * 1000.0, "token_weighted_step_ms": token_step_s * 1000.0,
        "overhead_of_tpot": 1.0 - token_step_s * 1000.0 / tpot["mean"] if tpots else float("nan"),
        "overhead_of_server_itl": 1.0 - token_step_s / server_itl_s,
    }  # fmt: skip


def print_table(name: str, res: dict) -> None:
    print(f"=========== {name} ===========")
    print(f"completed / failed           {res['completed']} / {res['failed']}  {res['errors'] or ''}")
    print(f"duration (s)                 {res['duration_s']:.2f}")
    print(f"request throughput (req/s)   {res['request_throughput']:.2f}")
    print(f"output throughput (tok/s)    {res['output_throughput']:.1f}")
    print(f"total throughput (tok/s)     {res['total_token_throughput']:.1f}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = res[key]
        print(f"{key[:-3].upper():5s} ms  " + "  ".join(f"{k} {v:8.2f}" for k, v in s.items()))
    print(f"engine step (ms, same run)   {res['engine_step_ms']:.2f} over {res['engine_steps']:.0f} steps, "
          f"engine busy {100 * res['engine_busy_fraction']:.0f}% of the run")  # fmt: skip
    print(f"token-weighted step (ms)     {res['token_weighted_step_ms']:.2f}  (the step each token came from)")
    print(f"server-side ITL mean (ms)    {res['server_itl_ms']:.2f}")
    print(f"overhead share of TPOT       {100 * res['overhead_of_tpot']:.1f}%  (1 - token-weighted step / mean TPOT)")
    print(f"overhead share of server ITL {100 * res['overhead_of_server_itl']:.1f}%")


def launch(args: Any, ep_size: int) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = [sys.executable, "-m", "server", "--config", args.launch_config, "--ep-size", str(ep_size),
           "--port", str(port), "--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise TimeoutError(f"server did not become healthy within {args.launch_timeout}s")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--launch-config", help="launch `python -m server --config X` per --ep-sizes instead")
    p.add_argument("--ep-sizes", default="1,2", help="EP sizes to launch, comma separated (with --launch-config)")
    p.add_argument("--port", type=int, default=8765, help="port for launched servers")
    p.add_argument("--max-num-seqs", type=int, default=16, help="per-worker slots for launched servers")
    p.add_argument("--launch-timeout", type=float, default=180.0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s); inf = burst")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [0, vocab)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", help="write the results as JSON here")
    args = p.parse_args(argv)
    if (args.base_url is None) == (args.launch_config is None):
        p.error("give exactly one of --base-url and --launch-config")
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "request_rate"},
                               "request_rate": str(args.request_rate), "runs": {}}  # fmt: skip
    if args.base_url:
        results["runs"]["server"] = asyncio.run(run_load(args.base_url, args))
    else:
        for ep in (int(x) for x in args.ep_sizes.split(",")):
            proc, url = launch(args, ep)
            try:
                results["runs"][f"ep{ep}"] = asyncio.run(run_load(url, args))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    for name, res in results["runs"].items():
        print_table(name, res)
    runs = results["runs"]
    if "ep1" in runs and "ep2" in runs:
        ratio = runs["ep2"]["output_throughput"] / runs["ep1"]["output_throughput"]
        results["ep2_over_ep1_output_throughput"] = ratio
        print(f"EP 2 / EP 1 output throughput: {ratio:.2f}x")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
