"""Fused MegaMoE vs the unfused dispatch -> experts -> combine, measured in the same run (issue 8).

For each EP size, every rank times (median over iterations of the slowest rank, after a barrier):
  fused    ``mega_moe(...)`` (per-local-expert-segment pipeline), once per ``--segments`` value
  unfused  ``moe_distribute_dispatch_v2`` -> all local experts' FFN -> ``moe_distribute_combine_v2``
  comm     the same dispatch + combine with no FFN in between (communication only)
  compute  the FFN alone on the rows one dispatch delivered (compute only)
and reports the best ``fused / unfused`` and the overlap achieved: ``hidden = (unfused - fused) / min(comm,
compute)``, the fraction of the shorter phase that the pipeline hid behind the longer one (1.0 = perfect overlap;
negative = the pipeline's extra collectives cost more than it hid).

    .venv/bin/python benchmarks/bench_mega_moe.py --ep 2 4 --json mega_moe.json
    .venv/bin/python benchmarks/bench_mega_moe.py --ep 2 4 --api buffer     # on a Buffer: its shm window on one host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import time_interleaved  # noqa: E402
from deep_ep_npu import Buffer  # noqa: E402
from deep_ep_npu.engine.ffn import grouped_ffn  # noqa: E402
from deep_ep_npu.mega_moe import mega_moe  # noqa: E402
from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2  # noqa: E402
from tests.support.distributed import parallel_launch  # noqa: E402


def _inputs(rank: int, world_size: int, cfg: dict):
    g = torch.Generator().manual_seed(1000 + rank)
    m, h, n, k, num_local = cfg["tokens"], cfg["hidden"], cfg["intermediate"], cfg["topk"], cfg["num_local_experts"]
    e = num_local * world_size
    x = torch.randn((m, h), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    probs = torch.softmax(torch.randn((m, k), generator=g), dim=-1)
    if cfg["weights"] == "int8":
        w1 = torch.randint(-127, 128, (num_local, h, 2 * n), generator=g, dtype=torch.int8)
        w2 = torch.randint(-127, 128, (num_local, n, h), generator=g, dtype=torch.int8)
        s1 = torch.full((num_local, 2 * n), 1.0 / (127 * h**0.5))
        s2 = torch.full((num_local, h), 1.0 / (127 * n**0.5))
    else:
        w1 = (torch.randn((num_local, h, 2 * n), generator=g) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn((num_local, n, h), generator=g) / n**0.5).to(torch.bfloat16)
        s1 = s2 = None
    return x, idx, probs, w1, w2, s1, s2


def _worker(info, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    group, w, rank = info.group, info.world_size, info.rank
    x, idx, probs, w1, w2, s1, s2 = _inputs(rank, w, cfg)
    e = cfg["num_local_experts"] * w
    out_dtype = torch.bfloat16
    quant_mode = 2 if s1 is not None else 0
    op_kw = dict(group_ep=group, ep_world_size=w, ep_rank_id=rank, moe_expert_num=e)

    buf = Buffer(group, transport=cfg["transport"], explicitly_destroy=True) if cfg["api"] == "buffer" else None

    def dispatch():  # (expand_x, dynamic_scales, expert_token_nums, the combine's handle)
        if buf is None:
            d = moe_distribute_dispatch_v2(x, idx, quant_mode=quant_mode, **op_kw)
            return d[0], d[1], d[3], (d[2], d[4])
        out, _, _ = buf.low_latency_dispatch_flat(x, idx, x.shape[0], e, quant_mode=quant_mode)
        return out.expand_x, out.dynamic_scales, out.expert_token_nums, out.handle

    def combine(y, handle):
        if buf is None:
            return moe_distribute_combine_v2(y, idx, handle[0], handle[1], probs, **op_kw)
        return buf.low_latency_combine_flat(y, idx, probs, handle)[0]

    def ffn(d):
        return grouped_ffn(d[0], d[1], d[2], range(cfg["num_local_experts"]), w1, w2, s1, s2, out_dtype)

    def unfused():
        d = dispatch()
        return combine(ffn(d), d[3])

    received = dispatch()
    zeros = torch.zeros((int(received[2].sum()), x.shape[1]), dtype=out_dtype)

    def comm():
        d = dispatch()
        return combine(zeros, d[3])

    def fused(num_segments: int):
        kw = dict(w1_scale=s1, w2_scale=s2, out_dtype=out_dtype, num_max_dispatch_tokens_per_rank=x.shape[0],
                  num_experts=e, num_segments=num_segments, segment_by=cfg["segment_by"])  # fmt: skip
        return (
            mega_moe(group, x, idx, probs, w1, w2, **kw) if buf is None else buf.mega_moe(x, idx, probs, w1, w2, **kw)
        )

    fns = {"unfused": unfused, "comm": comm, "compute": lambda: ffn(received)}
    for seg in cfg["segments"]:
        fns[f"fused_s{seg}"] = lambda seg=seg: fused(seg)
    samples = dict(zip(fns, time_interleaved(list(fns.values()), group, cfg["warmup"], cfg["iters"]), strict=True))
    res = {f"{name}_us": statistics.median(v) for name, v in samples.items()}
    for seg in cfg["segments"]:  # fused / unfused of the same iteration: robust to load that varies over the run
        pairs = zip(samples[f"fused_s{seg}"], samples["unfused"], strict=True)
        res[f"paired_ratio_s{seg}"] = statistics.median(f / u for f, u in pairs)
    ref = unfused().float()
    res["max_abs_diff_fused_vs_unfused"] = max((fused(s).float() - ref).abs().max().item() for s in cfg["segments"])
    res["max_abs_out"] = ref.abs().max().item()
    if buf is not None:
        buf.destroy()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="EP sizes (ranks) to run")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (M)")
    p.add_argument("--hidden", type=int, default=1024, help="K")
    p.add_argument("--intermediate", type=int, default=256, help="N")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-local-experts", type=int, default=8)
    p.add_argument("--weights", choices=["int8", "bf16"], default="int8")
    p.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4], help="pipeline segments to time")
    p.add_argument("--segment-by", choices=["expert", "token"], default="expert", help="how segments split the work")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--api",
        choices=["ops", "buffer"],
        default="ops",
        help="ops: mega_moe() and the ops (collective); buffer: Buffer.mega_moe and its flat methods",
    )
    p.add_argument("--transport", choices=["auto", "shm", "collective"], default="auto", help="with --api buffer")
    p.add_argument("--json", type=str, default=None, help="write the results here")
    a = p.parse_args()
    cfg = {k: v for k, v in vars(a).items() if k not in ("ep", "json")}
    rows = []
    print(f"shape: {cfg}")
    fused_cols = " ".join(f"{'fused S=' + str(seg) + ' µs':>14}" for seg in a.segments)
    print(
        f"{'EP':>3} {'unfused µs':>11} {fused_cols} {'best ratio':>10} {'comm µs':>8} {'compute µs':>11} {'hidden':>7}"
    )
    for w in a.ep:
        load_before = os.getloadavg()[0]
        res = parallel_launch(w, _worker, cfg, timeout=900, pg_timeout=600)[0]
        res["loadavg_1min"] = [load_before, os.getloadavg()[0]]  # this machine may be shared: say how busy it was
        best = min(a.segments, key=lambda seg: res[f"paired_ratio_s{seg}"])
        res.update(ep=w, best_segments=best, fused_us=res[f"fused_s{best}_us"], ratio=res[f"paired_ratio_s{best}"])
        res["hidden"] = (res["unfused_us"] - res["fused_us"]) / min(res["comm_us"], res["compute_us"])
        rows.append(res)
        fused_vals = " ".join(f"{res[f'fused_s{seg}_us']:>14.0f}" for seg in a.segments)
        print(
            f"{w:>3} {res['unfused_us']:>11.0f} {fused_vals} {res['ratio']:>10.2f} {res['comm_us']:>8.0f} "
            f"{res['compute_us']:>11.0f} {res['hidden']:>7.2f}   (load {load_before:.1f})"
        )
    print("best ratio: median over iterations of fused / unfused measured back to back, best segment count")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": cfg, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
