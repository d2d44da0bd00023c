"""Time to first token with prefix caching: a request whose 256-token prefix a finished request left in the cache,
against the first request with that prefix, measured in the same run.

The model is the decode benchmark's (a random Qwen3-MoE built and saved with transformers: hidden 1024, 4 layers, 64
experts, top-8, bf16). Per round, with a fresh random ``--prefix-len`` prefix: request A (prefix + 16 tokens of its
own) runs alone to its first token, then request B (same prefix + 16 other tokens). TTFT is ``add_request`` to the
step that returns the first token (driver included). The same rounds run on an engine with prefix caching off, as
the control (B is not faster there). Prints the medians over ``--rounds`` and B's prefix-cache hits.

    .venv/bin/python benchmarks/bench_prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.hf_decode import make_checkpoint, prompts  # noqa: E402


def ttft_s(engine, request_id: str, token_ids: list[int]) -> float:  # noqa: ANN001
    """Seconds from adding a greedy one-token request to the step that returns its token (then drained)."""
    from server.engine_api import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(request_id, token_ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        deltas = engine.step()
        if first is None and any(d.new_token_ids for d in deltas):
            first = time.perf_counter() - t0
    assert first is not None
    return first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from server.runtime import EPEngine

    sizes = dict(vocab_size=1024, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=64, intermediate_size=2048, moe_intermediate_size=512, num_experts=64,
                 num_experts_per_tok=8)  # fmt: skip
    ckpt = tempfile.TemporaryDirectory(prefix="bench_prefix_")
    make_checkpoint(ckpt.name, getattr(torch, args.dtype), seed=0, **sizes)
    engines = {}
    results = {}
    try:
        for caching in (True, False):
            engines[caching] = EPEngine(model=ckpt.name, ep_size=args.ep, dtype=args.dtype,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_model_len=args.prefix_len + args.suffix_len + 8,
                                        enable_prefix_caching=caching)  # fmt: skip
        for caching, engine in engines.items():
            first, second, hits = [], [], []
            for r in range(args.rounds + 1):  # round 0 warms up
                prefix = prompts(1, args.prefix_len, 1024, seed=100 + r)[0]
                a, b = prompts(2, args.suffix_len, 1024, seed=200 + r)
                hits_before = sum(s.kv.num_hits for s in engine.schedulers)
                ta = ttft_s(engine, f"a{r}", prefix + a)
                tb = ttft_s(engine, f"b{r}", prefix + b)
                if r:
                    first.append(ta)
                    second.append(tb)
                    hits.append(sum(s.kv.num_hits for s in engine.schedulers) - hits_before)
            name = "prefix caching on" if caching else "prefix caching off"
            results[name] = {"ttft_first_ms": statistics.median(first) * 1e3,
                             "ttft_second_ms": statistics.median(second) * 1e3,
                             "speedup": statistics.median(a / b for a, b in zip(first, second, strict=True)),
                             "hit_tokens": hits}  # fmt: skip
            row = results[name]
            print(f"{name:<19} TTFT first {row['ttft_first_ms']:7.1f} ms, second (shared {args.prefix_len}-token "
                  f"prefix) {row['ttft_second_ms']:7.1f} ms: {row['speedup']:.2f}x sooner; prefix hits {hits}",
                  flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
        ckpt.cleanup()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
