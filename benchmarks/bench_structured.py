"""Decode throughput with structured output: a batch where some requests carry a JSON schema against the same batch
unconstrained, measured in the same run.

One ``EPEngine`` (a random model: the server's default unless ``--random-model`` overrides it) decodes a batch of
``--batch`` requests, ``--tokens`` new tokens each after ``--prompt-len``-token prompts. In the constrained variant
``--constrained`` of them carry a JSON schema (an array of short strings with more items than the output can hold,
so every request runs all ``--tokens`` steps and the grammar never lets it end early); in the baseline none do.
Everything else is equal: greedy, ``ignore_eos`` on the unconstrained requests. Decode tokens/s = batch / a step
time (the time between consecutive ``EPEngine.step()`` calls that return tokens, after ``--skip`` steps), so the
grammar's whole cost on the driver and the workers counts. The step time is the median, and also the 20th
percentile: on a machine shared with other load the low percentile tracks the uncontended cost, the median the
bursts. The variants alternate for ``--repeats`` rounds; the report gives each round's ratios (constrained /
baseline) and their median and range.

    .venv/bin/python benchmarks/bench_structured.py                  # batch 16, 8 constrained, EP 2

A second, in-process measurement isolates what the grammar adds to a step: one worker's sampling of a decode step
(``Worker._sample``, the code the workers run) for ``--batch`` rows of random logits, with and without the
``--constrained`` requests' grammars, ``--sample-steps`` steps each, alternating; the added microseconds per step
against the engine's step time give the expected ratio without the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1000}


def step_times(engine, prompts: list[list[int]], constrained: int, grammar, num_new: int, tag: str) -> list[float]:  # noqa: ANN001
    """Times between consecutive token-producing steps while the batch decodes."""
    import dataclasses

    from server.engine_api import SamplingParams

    plain = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, dataclasses.replace(plain, grammar=grammar) if i < constrained else plain)
    stamps = []
    while engine.has_unfinished_requests():
        if any(d.new_token_ids for d in engine.step()):
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def sampling_cost(vocab_size: int, tokenizer, grammar, batch: int, constrained: int, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """Median seconds of one worker's ``_sample`` for a decode step of ``batch`` greedy rows: (none constrained,
    ``constrained`` of them constrained). Each grammar is restarted when it completes."""
    import dataclasses
    import types

    import torch

    from server.engine_api import SamplingParams
    from server.models import SeqInput
    from server.runtime.sampling.grammar import WorkerGrammars
    from server.runtime.sampling.request_sampler import RequestSampler
    from server.runtime.workers.worker import Worker, _Seq

    grammars = WorkerGrammars(lambda: tokenizer, vocab_size)
    worker = types.SimpleNamespace(model=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab_size)))
    fallback = torch.Generator().manual_seed(0)
    plain = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)

    def seqs(n: int) -> list:
        out = []
        for i in range(batch):
            params = dataclasses.replace(plain, grammar=grammar) if i < n else plain
            sampler = RequestSampler(params, fallback, vocab_size, grammars.start(grammar) if i < n else None)
            sampler.sampled = True
            out.append(_Seq(sampler))
        return out

    variants = {0: seqs(0), constrained: seqs(constrained)}
    inputs = [SeqInput([0], 0, [1]) for _ in range(batch)]
    times: dict[int, list[float]] = {0: [], constrained: []}
    for _ in range(steps):
        for n, group in variants.items():
            logits = torch.randn(batch, vocab_size)
            t0 = time.perf_counter()
            Worker._sample(worker, group, inputs, logits)  # type: ignore[arg-type]
            times[n].append(time.perf_counter() - t0)
            for seq in group:
                if seq.sampler.grammar is not None and not seq.sampler.grammar.constrains:
                    seq.sampler.grammar = grammars.start(grammar)
    return statistics.median(times[0]), statistics.median(times[constrained])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--skip", type=int, default=4, help="decode steps left out at the start")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--random-model", type=json.loads, default={}, help="JSON, e.g. '{\"hidden_size\": 256}'")
    parser.add_argument("--sample-steps", type=int, default=2000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from server.runtime.engine import EPEngine
    from server.structured.compiler import GrammarCache
    from server.structured.spec import GrammarSpec

    engine = EPEngine(
        ep_size=args.ep,
        backend="reference",
        max_num_seqs=args.batch,
        max_model_len=512,
        random_model=args.random_model,
        step_timeout_s=120,
    )
    try:
        grammar, compile_s = GrammarCache(engine.tokenizer, engine.vocab_size).compile(
            GrammarSpec("json", json.dumps(SCHEMA), "bench")
        )
        rng = random.Random(0)
        rounds = []
        for r in range(args.repeats + 1):  # round 0 warms up (worker grammar set-up, allocator)
            prompts = [[rng.randrange(32, 127) for _ in range(args.prompt_len)] for _ in range(args.batch)]
            tok_s = {}
            order = [("baseline", 0), ("constrained", args.constrained)]
            for name, n in order if r % 2 else order[::-1]:  # alternating which goes first
                times = sorted(step_times(engine, prompts, n, grammar, args.tokens, f"{r}-{name}")[args.skip :])
                tok_s[name] = (args.batch / statistics.median(times), args.batch / times[len(times) // 5])
            if r:
                rounds.append(tok_s)
                (bm, bp), (cm, cp) = tok_s["baseline"], tok_s["constrained"]
                print(
                    f"round {r}: tok/s (median step / p20 step) baseline {bm:.0f} / {bp:.0f}, "
                    f"{args.constrained} of {args.batch} constrained {cm:.0f} / {cp:.0f}; "
                    f"ratio {cm / bm:.3f} / {cp / bp:.3f}",
                    flush=True,
                )
        for i, stat in enumerate(("median step", "p20 step")):
            ratios = [x["constrained"][i] / x["baseline"][i] for x in rounds]
            print(
                f"ratio constrained / baseline ({stat}): median {statistics.median(ratios):.3f}, range "
                f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} rounds"
            )
        print(f"grammar compiled in {compile_s * 1e3:.0f} ms")
        plain_s, constrained_s = sampling_cost(
            engine.vocab_size,
            engine.tokenizer,
            grammar,
            args.batch // args.ep,
            args.constrained // args.ep,
            args.sample_steps,
        )
        base_step = statistics.median(args.batch / x["baseline"][1] for x in rounds)
        added = constrained_s - plain_s
        print(
            f"one worker's sampling of a step ({args.batch // args.ep} rows): {plain_s * 1e6:.0f} us unconstrained, "
            f"{constrained_s * 1e6:.0f} us with {args.constrained // args.ep} constrained: +{added * 1e6:.0f} us "
            f"per step; against the baseline p20 step of {base_step * 1e3:.2f} ms, expected ratio "
            f"{base_step / (base_step + added):.3f}"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "args": vars(args),
                        "rounds": rounds,
                        "compile_s": compile_s,
                        "sampling_s": [plain_s, constrained_s],
                    },
                    f,
                    indent=1,
                )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
