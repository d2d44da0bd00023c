"""Decode throughput of the EP runtime against transformers on the same checkpoint, and against the weights-read
floor, all measured in the same run.

A random Qwen3-MoE (default: hidden 1024, 4 layers, 64 experts, top-8, expert intermediate 512, bf16) is built with
transformers and saved; our engine (``EPEngine``, one per EP size, all alive at once) and transformers' ``generate``
load that directory. Per batch size, each run decodes ``--short`` and then ``--long`` new tokens greedily after
``batch`` fresh random prompts of ``--prompt-len`` tokens (``ignore_eos``); decode tokens/s = ``batch * (long -
short) / (t_long - t_short)``, so prefill and fixed costs cancel. Ours is timed through ``add_request`` / ``step``
(scheduling, detokenization and the driver included). The engines run interleaved, ``--repeats`` times, in a
fresh order each round. The floor is the time to read one decode step's weights once (``hf_decode.HFDecode.
floor_ms``). Batch b at EP W puts b/W requests on each worker (DP attention).

    .venv/bin/python benchmarks/bench_decode.py                       # EP 1 and 2, batch 1 and 16, transformers
    .venv/bin/python benchmarks/bench_decode.py --ep 2 --backend reference ascend --simulate-npu --no-transformers
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


def ours_s(engine, token_ids: list[list[int]], num_new: int, tag: str) -> tuple[float, float]:  # noqa: ANN001
    """Seconds to generate ``num_new`` tokens greedily after each prompt, and the share of the steps' time the
    slowest worker spent in MoE dispatch + combine."""
    from server.engine_api import SamplingParams

    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    for i, ids in enumerate(token_ids):
        engine.add_request(f"{tag}-{i}", ids, params)
    comm = 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step_stats()
        comm += max((d + c for d, c in zip(s.dispatch_times, s.combine_times, strict=True)), default=0.0)
    took = time.perf_counter() - t0
    return took, comm / took


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
    p.add_argument("--short", type=int, default=8, help="new tokens of the short run")
    p.add_argument("--long", type=int, default=72, help="new tokens of the long run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", nargs="+", default=["reference"], choices=["reference", "ascend", "auto"])
    p.add_argument("--simulate-npu", action="store_true", help="install deep_ep_npu.sim in every worker")
    p.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the baseline rows")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from server.runtime import EPEngine

    dtype = getattr(torch, args.dtype)
    sizes = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                 moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
                 num_experts_per_tok=args.top_k)  # fmt: skip
    ckpt = tempfile.TemporaryDirectory(prefix="bench_decode_")
    make_checkpoint(ckpt.name, dtype, seed=0, **sizes)
    names = [(ep, b) for ep in args.ep for b in (args.backend if ep > 1 else args.backend[:1])]
    engines = {}
    hf = HFDecode(ckpt.name, dtype) if args.transformers else None
    results = []
    try:
        for ep, backend in names:
            engines[ep, backend] = EPEngine(model=ckpt.name, ep_size=ep, dtype=args.dtype, backend=backend,
                                            max_num_seqs=max(args.batch), simulate_npu=args.simulate_npu,
                                            max_model_len=args.prompt_len + args.long + 8,
                                            async_scheduling=args.async_scheduling)  # fmt: skip
        runs: dict[str, tuple] = {f"EP {ep} {backend}": ("ours", engines[ep, backend]) for ep, backend in names}
        if hf is not None:
            runs["transformers"] = ("hf", hf)
        for batch in args.batch:
            tps: dict[str, list[float]] = {name: [] for name in runs}
            shares: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.repeats):
                order = list(runs)
                random.Random(r).shuffle(order)
                for name in order:
                    kind, impl = runs[name]
                    seconds = []
                    for n in (args.short, args.long):
                        seed = 10**6 * list(runs).index(name) + 1000 * batch + 10 * r + (n == args.long)
                        ids = prompts(batch, args.prompt_len, args.vocab_size, seed)
                        if kind == "hf":
                            seconds.append(impl.generate_s(ids, n))
                        else:
                            took, share = ours_s(impl, ids, n, f"b{batch}-r{r}-n{n}")
                            seconds.append(took)
                            shares[name].append(share)
                    tps[name].append(batch * (args.long - args.short) / (seconds[1] - seconds[0]))
            floor_ms, floor_bytes = (
                hf.floor_ms(prompts(batch, args.prompt_len, args.vocab_size, seed=batch), 16) if hf else (None, None)
            )
            for name in runs:
                med = statistics.median(tps[name])
                row = {"engine": name, "batch": batch, "tokens_per_s": med, "tokens_per_s_runs": tps[name],
                       "step_ms": batch / med * 1e3, "dispatch_combine_share": statistics.fmean(shares[name] or [0]),
                       "floor_ms": floor_ms, "floor_bytes": floor_bytes}  # fmt: skip
                if "transformers" in tps:
                    row["vs_transformers"] = med / statistics.median(tps["transformers"])
                if floor_ms:
                    row["step_over_floor"] = row["step_ms"] / floor_ms
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
    if row["dispatch_combine_share"]:
        text += f"  disp+comb {100 * row['dispatch_combine_share']:.0f}%"
    return text


if __name__ == "__main__":
    sys.exit(main())
