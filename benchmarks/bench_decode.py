"""Decode throughput of the EP runtime against transformers on the same checkpoint, and against the weights-read
floor, all measured in the same run.

A random Qwen3-MoE (default: hidden 1024, 4 layers, 64 experts, top-8, expert intermediate 512, bf16) is built with
transformers and saved; our engine (``EPEngine``, one per EP size, all alive at once) and transformers' ``generate``
load that directory. Per batch size and round, each engine decodes ``--tokens`` new tokens greedily after ``batch``
fresh random prompts of ``--prompt-len`` tokens (``ignore_eos``), and the time between consecutive steps' tokens is
recorded where the caller receives them (ours: each ``EPEngine.step()`` that returns tokens, so scheduling,
detokenization and the driver count; transformers: a streamer's ``put()``); the prefill and the first ``--skip``
decode steps are left out. Decode tokens/s = batch / the median step; the median resists the bursts of other load on
a shared machine. The engines run interleaved, ``--repeats`` rounds, in a fresh order each round; "x transformers" is
the median over rounds of the round's ratio. The floor is the time to read one decode step's weights once
(``hf_decode.HFDecode.floor_ms``). Batch b at EP W puts b/W requests on each worker (DP attention).

    .venv/bin/python benchmarks/bench_decode.py                       # EP 1 and 2, batch 1 and 16, transformers
    .venv/bin/python benchmarks/bench_decode.py --ep 2 --backend reference ascend --simulate-npu --no-transformers

``--skew S``: Zipf-skewed routing (the config key ``routing_skew``: each token's top-k drawn with probability
proportional to ``(e + 1) ** -S``, so the hot experts start on worker 0; no transformers rows) and, per EP size > 1,
a second engine with EPLB (``--eplb-interval``, ``--num-redundant-experts``) in the same rounds: step times under
skew before / after balancing, and each engine's balancedness (per MoE layer, mean / max over workers of the rows
their experts received, summed over the measured steps; the mean over layers is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.hf_decode import HFDecode, make_checkpoint, prompts  # noqa: E402


def ours_step_times(engine, token_ids: list[list[int]], num_new: int, tag: str,  # noqa: ANN001
                    loads: dict | None = None) -> tuple[list[float], float]:  # fmt: skip
    """Generate ``num_new`` tokens greedily after each prompt; returns when each step's tokens came out of
    ``engine.step()`` (``time.perf_counter``) and the share of the time the slowest worker spent in MoE dispatch +
    combine. ``loads`` (rank -> per MoE layer) gets each step's received expert rows added."""
    from server.engine_api import SamplingParams

    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    for i, ids in enumerate(token_ids):
        engine.add_request(f"{tag}-{i}", ids, params)
    times, comm = [], 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if any(d.new_token_ids for d in engine.step()):
            times.append(time.perf_counter())
        s = engine.last_step_stats()
        for rank, per_layer in s.expert_loads.items() if loads is not None else ():
            row = loads.setdefault(rank, [0] * len(per_layer))
            loads[rank] = [a + b for a, b in zip(row, per_layer, strict=True)]
        comm += max((d + c for d, c in zip(s.dispatch_times, s.combine_times, strict=True)), default=0.0)
    return times, comm / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--moe-intermediate-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--skip", type=int, default=2, help="decode steps left out after the prefill")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", nargs="+", default=["reference"], choices=["reference", "ascend", "auto"])
    p.add_argument("--simulate-npu", action="store_true", help="install deep_ep_npu.sim in every worker")
    p.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the baseline rows")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: the engine's)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the routing (0: the router's own)")
    p.add_argument("--eplb-interval", type=int, default=16, help="with --skew: steps between EPLB rebalances")
    p.add_argument("--num-redundant-experts", type=int, default=4, help="with --skew: the EPLB engines' R")
    args = p.parse_args(argv)
    if args.skew:
        args.transformers = False  # transformers' router is not skewed

    from server.runtime import EPEngine

    dtype = getattr(torch, args.dtype)
    sizes = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                 moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
                 num_experts_per_tok=args.top_k)  # fmt: skip
    ckpt = tempfile.TemporaryDirectory(prefix="bench_decode_")
    make_checkpoint(ckpt.name, dtype, seed=0, **sizes)
    if args.skew:
        with open(os.path.join(ckpt.name, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(ckpt.name, "config.json"), "w") as f:
            json.dump({**config, "routing_skew": args.skew}, f)
    names = [(ep, b) for ep in args.ep for b in (args.backend if ep > 1 else args.backend[:1])]
    if args.skew:
        names += [(ep, b + " +eplb") for ep in args.ep if ep > 1 for b in args.backend]
    engines = {}
    hf = HFDecode(ckpt.name, dtype) if args.transformers else None
    results = []
    try:
        for ep, backend in names:
            eplb = {}
            if backend.endswith(" +eplb"):
                eplb = dict(eplb=True, eplb_interval=args.eplb_interval, eplb_window=args.eplb_interval,
                            num_redundant_experts=args.num_redundant_experts)  # fmt: skip
            engines[ep, backend] = EPEngine(model=ckpt.name, ep_size=ep, dtype=args.dtype,
                                            backend=backend.removesuffix(" +eplb"),
                                            max_num_seqs=max(args.batch), simulate_npu=args.simulate_npu,
                                            max_model_len=args.prompt_len + args.tokens + 8,
                                            async_scheduling=args.async_scheduling,
                                            worker_threads=args.worker_threads, **eplb)  # fmt: skip
        runs: dict[str, tuple] = {f"EP {ep} {backend}": ("ours", engines[ep, backend]) for ep, backend in names}
        if hf is not None:
            runs["transformers"] = ("hf", hf)
        for batch in args.batch:
            steps: dict[str, list[float]] = {name: [] for name in runs}  # every round's decode steps (seconds)
            tps: dict[str, list[float]] = {name: [] for name in runs}  # per round
            shares: dict[str, list[float]] = {name: [] for name in runs}
            loads: dict[str, dict] = {name: {} for name in runs}  # rank -> rows per MoE layer
            floors: list[tuple[float, float]] = []  # per round: the floor (ms) and its bytes
            for r in range(args.repeats):
                if hf is not None:
                    floors.append(hf.floor_ms(prompts(batch, args.prompt_len, args.vocab_size, seed=7 + r), 16))
                order = list(runs)
                random.Random(r).shuffle(order)
                for name in order:
                    kind, impl = runs[name]
                    ids = prompts(batch, args.prompt_len, args.vocab_size, 10**6 * list(runs).index(name) + 100 * r)
                    if kind == "hf":
                        times = impl.step_times(ids, args.tokens)
                    else:
                        times, share = ours_step_times(impl, ids, args.tokens, f"b{batch}-r{r}", loads[name])
                        shares[name].append(share)
                    decode = [b - a for a, b in zip(times, times[1:], strict=False)][args.skip :]
                    steps[name] += decode
                    tps[name].append(batch / statistics.median(decode))
            floor_ms = statistics.median(f for f, _ in floors) if floors else None
            floor_bytes = statistics.median(b for _, b in floors) if floors else None
            for name in runs:
                med = batch / statistics.median(steps[name])
                row = {"engine": name, "batch": batch, "tokens_per_s": med, "tokens_per_s_runs": tps[name],
                       "step_ms": batch / med * 1e3, "dispatch_combine_share": statistics.fmean(shares[name] or [0]),
                       "floor_ms": floor_ms, "floor_bytes": floor_bytes}  # fmt: skip
                if "transformers" in tps:  # the median of the rounds' ratios: a round's runs share its load
                    ratios = [ours / base for ours, base in zip(tps[name], tps["transformers"], strict=True)]
                    row["vs_transformers"] = statistics.median(ratios)
                if floor_ms:
                    row["step_over_floor"] = row["step_ms"] / floor_ms
                if len(loads[name]) > 1:
                    columns = list(zip(*loads[name].values(), strict=True))
                    row["balancedness"] = statistics.fmean(sum(c) / len(c) / max(c) for c in columns if max(c))
                results.append(row)
                print(_line(row), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
        ckpt.cleanup()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


def _line(row: dict) -> str:
    runs = " / ".join(f"{v:.1f}" for v in row["tokens_per_s_runs"])
    text = f"batch {row['batch']:>3}  {row['engine']:<16} {row['tokens_per_s']:8.1f} tok/s ({runs})"
    text += f"  step {row['step_ms']:7.2f} ms"
    if "vs_transformers" in row:
        text += f"  {row['vs_transformers']:5.2f}x transformers"
    if row.get("floor_ms"):
        text += f"  floor {row['floor_ms']:.2f} ms ({row['floor_bytes'] / 1e6:.0f} MB), step/floor"
        text += f" {row['step_over_floor']:.2f}"
    if "balancedness" in row:
        text += f"  balancedness {row['balancedness']:.3f}"
    if row["dispatch_combine_share"]:
        text += f"  disp+comb {100 * row['dispatch_combine_share']:.0f}%"
    return text


if __name__ == "__main__":
    sys.exit(main())
