"""Decode throughput of the EP runtime: tokens/s and per-step latency at batch 1..64 for EP 1 and EP 2.

An expert-heavy random Qwen3-MoE (default: 64 experts, hidden 1024, top-8) is served by ``EPEngine``; each batch
size runs ``--warmup`` + ``--steps`` decode steps after the prefill (requests use ``ignore_eos``). Reported per
(EP, batch): decode tokens/s, mean/p50 step latency (ms), the share of step time spent in dispatch + combine
(max over ranks), and per-rank expert memory and peak RSS after loading. Batch b at EP W puts b/W requests on each
worker (DP attention). ``--backend`` lists the ``deep_ep_npu.Buffer`` backends to measure in the same run (EP 1
has no Buffer: one row, "local"); ``--simulate-npu`` installs the NPU stand-in in every worker, so ``ascend`` runs
the Ascend backend's code path on CPU. Writes JSON with ``--out``.

    .venv/bin/python benchmarks/bench_decode.py --ep 1 2 --batch 1 8 32 64
    .venv/bin/python benchmarks/bench_decode.py --ep 2 --backend reference ascend --simulate-npu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def run_one(engine, batch: int, warmup: int, steps: int, prompt_len: int) -> dict:  # noqa: ANN001
    from server.engine_api import SamplingParams

    params = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)  # aborted after the timed steps
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [(13 * i + j) % 250 + 1 for j in range(prompt_len)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started.update(d.request_id for d in engine.step())
    times, comm = [], []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        if k >= warmup:
            assert len(deltas) == batch, (len(deltas), batch)
            times.append(dt)
            s = engine.last_step_stats()
            comm.append(max(d + c for d, c in zip(s.dispatch_times, s.combine_times, strict=True)))
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    engine.step()
    mean = statistics.fmean(times)
    return {
        "batch": batch,
        "tokens_per_s": batch / mean,
        "step_ms_mean": mean * 1e3,
        "step_ms_p50": statistics.median(times) * 1e3,
        "dispatch_combine_share": statistics.fmean(comm) / mean,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--moe-intermediate-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", nargs="+", default=["reference"], choices=["reference", "ascend", "auto"])
    p.add_argument("--simulate-npu", action="store_true", help="install deep_ep_npu.sim in every worker")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from server.runtime import EPEngine

    spec = dict(
        num_experts=args.num_experts, hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        num_experts_per_tok=args.top_k, num_hidden_layers=args.num_layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, vocab_size=1024,
    )  # fmt: skip
    results = []
    runs = [(ep, backend) for ep in args.ep for backend in (args.backend if ep > 1 else args.backend[:1])]
    for ep, backend in runs:
        max_per_rank = max(-(-b // ep) for b in args.batch)
        engine = EPEngine(model=None, ep_size=ep, dtype=args.dtype, random_model=spec, max_num_seqs=max_per_rank,
                          max_model_len=args.prompt_len + args.warmup + args.steps + 80, backend=backend,
                          simulate_npu=args.simulate_npu)  # fmt: skip
        name = engine.worker_infos[0]["moe_backend"]
        name += " (sim)" if args.simulate_npu and name == "ascend" else ""
        try:
            infos = engine.worker_infos
            mem = {
                "expert_mib_per_rank": max(i["expert_bytes"] for i in infos) / 2**20,
                "weight_mib_per_rank": max(i["weight_bytes"] for i in infos) / 2**20,
                "peak_rss_mib_per_rank": max(i["peak_rss_after_load"] for i in infos) / 2**20,
                "load_rss_delta_mib_per_rank": max(i["peak_rss_after_load"] - i["rss_before_load"] for i in infos)
                / 2**20,
            }
            print(f"EP {ep}, backend {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items()), flush=True)
            print(f"{'EP':>3} {'backend':>14} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'p50 ms':>8} {'disp+comb':>9}",
                  flush=True)  # fmt: skip
            for b in args.batch:
                r = {"ep": ep, "backend": name, **run_one(engine, b, args.warmup, args.steps, args.prompt_len), **mem}
                results.append(r)
                print(f"{ep:>3} {name:>14} {b:>5} {r['tokens_per_s']:>9.1f} {r['step_ms_mean']:>8.2f} "
                      f"{r['step_ms_p50']:>8.2f} {100 * r['dispatch_combine_share']:>8.1f}%", flush=True)  # fmt: skip
        finally:
            engine.shutdown()
    by = {(r["ep"], r["batch"]): r for r in results if r["backend"] in ("local", args.backend[0])}
    for b in args.batch:
        if (1, b) in by and (2, b) in by:
            print(f"batch {b}: EP 2 / EP 1 tokens/s = {by[2, b]['tokens_per_s'] / by[1, b]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
