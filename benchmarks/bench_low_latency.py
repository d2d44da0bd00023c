"""Low-latency dispatch/combine benchmark: ours vs an all-to-all floor and the all-gather/reduce-scatter fallback.

Every implementation runs in the same process group, on the same data, in the same run:

- ``ours``: ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` (one-shot);
- ``ours_hook``: the same with ``return_recv_hook=True`` and ``hook()`` called at once (send + receive phases);
- ``ours_collective``: ``ours`` on the collective transport (``--transport`` picks ``ours``'s; default ``auto``:
  the shared-memory window on one host);
- ``memcpy_floor``: every rank at once copies the bytes the op must write (dispatch: the filled rows of
  ``recv_x``; combine: the rows read + the fp32 reduction output) with one ``copy_``;
- ``a2a_floor``: one ``all_to_all_single`` moving exactly our payload bytes per destination;
- ``allgather_rs``: all-gather tokens + top-k, local experts on every rank, reduce-scatter back;
- ``elastic_fresh`` / ``elastic_cached`` / ``elastic``: ``ElasticBuffer`` (DeepEP V2) decode-style dispatch with a
  fresh layout / a cached handle (no count exchange), and its combine (:mod:`benchmarks.elastic_cases`).

Latency is barrier-aligned per iteration and taken as the max over ranks; we report median / min / max over the
timed iterations after warm-up. The implementations run interleaved (each iteration runs every one of them, in a
random order), and ``ours`` also reports the median of its same-iteration ratios to ``memcpy_floor``,
``ours_collective`` and ``a2a_floor`` (``paired_ratio_to_*``). Bandwidth is counted the DeepEP way: bytes per valid
(token, k) selection (bf16: 2H; fp8: H + H/128*4 + 16; int8: H + 4 + 16) over the median latency.
``wire_bytes_per_rank`` is what one rank actually sends to other ranks (payload + headers for ours).

    python benchmarks/bench_low_latency.py --num-processes 4 --num-tokens 128 --hidden 4096 --num-topk 8 \\
        --num-experts 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.baselines import A2AFloor, AllGatherReduceScatter, MemcpyFloor  # noqa: E402
from benchmarks.elastic_cases import elastic_cases  # noqa: E402
from benchmarks.timing import time_interleaved  # noqa: E402
from deep_ep_npu import Buffer, profiling  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _stats(us: list[float]) -> dict:
    return {"median": statistics.median(us), "min": min(us), "max": max(us)}


def _selection_bytes(hidden: int, quant: str, dtype: torch.dtype) -> int:
    if quant == "fp8":
        return hidden + hidden // 128 * 4 + 16
    if quant == "int8":
        return hidden + 4 + 16
    return hidden * dtype.itemsize


def _make_inputs(rank: int, args, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1234 + rank)
    x = (torch.randn(args.num_tokens, args.hidden, generator=gen) * 0.1).to(dtype)
    scores = torch.randn(args.num_tokens, args.num_experts, generator=gen).abs() + 1
    topk_idx = torch.topk(scores, args.num_topk, dim=-1).indices
    topk_weights = torch.rand(args.num_tokens, args.num_topk, generator=gen)
    return x, topk_idx, topk_weights


def _run_rank(rank: int, args, port: int, results_path: str) -> None:
    torch.set_num_threads(1)
    w = args.num_processes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=w)
    group = dist.group.WORLD
    dtype = DTYPES[args.dtype]
    x, topk_idx, topk_weights = _make_inputs(rank, args, dtype)
    buffer = Buffer(
        group, low_latency_mode=True, num_qps_per_rank=max(args.num_experts // w, 1), explicitly_destroy=True,
        transport=args.transport,
    )  # fmt: skip
    coll = Buffer(group, low_latency_mode=True, explicitly_destroy=True, transport="collective")
    n, e = args.num_tokens, args.num_experts
    quant = args.quant
    kw = {"use_fp8": quant == "fp8"}
    if quant == "int8":
        kw = {"use_fp8": True, "quant_format": "int8_per_token"}

    def dispatch():
        return buffer.low_latency_dispatch(x, topk_idx, n, e, **kw)

    def dispatch_hook():
        out = buffer.low_latency_dispatch(x, topk_idx, n, e, return_recv_hook=True, **kw)
        out[4]()
        return out

    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, n, e, use_fp8=False)
    # the experts' output: its own tensor, as in DeepEP's test (recv_x itself is rewritten by every other dispatch)
    expert_out = recv_x.to(torch.bfloat16, copy=True)

    def combine():
        return buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    def dispatch_coll():
        return coll.low_latency_dispatch(x, topk_idx, n, e, **kw)

    _, _, coll_handle, _, _ = coll.low_latency_dispatch(x, topk_idx, n, e, use_fp8=False)

    def combine_coll():
        return coll.low_latency_combine(expert_out, topk_idx, topk_weights, coll_handle)

    # memcpy floors: one copy of the bytes the op must write, in every rank at once (the same cores as the op)
    recv_x_bytes = int(recv_count.sum()) * args.hidden * (1 if quant != "none" else dtype.itemsize)
    comb_bytes = int(recv_count.sum()) * args.hidden * 2 + x.shape[0] * args.hidden * 4
    disp_memcpy, comb_memcpy = MemcpyFloor(recv_x_bytes), MemcpyFloor(comb_bytes)

    def combine_hook():
        out = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle, return_recv_hook=True)
        out[2]()
        return out

    dispatch()  # the timed dispatch's format, then one combine: their wire bytes size the a2a floor
    combine()
    stats = profiling.wire_stats(buffer)
    disp_floor = A2AFloor(stats["dispatch_send_bytes"], group)
    comb_floor = A2AFloor(stats["combine_send_bytes"], group)
    agrs = AllGatherReduceScatter(e, group)
    gathered = agrs.dispatch(x, topk_idx, topk_weights)
    ag_disp_bytes, ag_comb_bytes = AllGatherReduceScatter.wire_bytes(x, topk_idx, w)

    num_sel = torch.tensor([int((topk_idx >= 0).sum())], dtype=torch.int64)
    dist.all_reduce(num_sel, group=group)
    sel_per_rank = num_sel.item() / w
    sel_bytes = _selection_bytes(args.hidden, quant, dtype)
    comb_sel_bytes = args.hidden * 2

    cases = [
        ("dispatch", "ours", dispatch, stats["dispatch_wire_bytes"], sel_bytes),
        ("dispatch", "ours_hook", dispatch_hook, stats["dispatch_wire_bytes"], sel_bytes),
        ("dispatch", "ours_collective", dispatch_coll, stats["dispatch_wire_bytes"], sel_bytes),
        ("dispatch", "memcpy_floor", disp_memcpy, recv_x_bytes, sel_bytes),
        ("dispatch", "a2a_floor", disp_floor, disp_floor.wire_bytes, sel_bytes),
        ("dispatch", "allgather_rs", lambda: agrs.dispatch(x, topk_idx, topk_weights), ag_disp_bytes, sel_bytes),
        ("combine", "ours", combine, stats["combine_wire_bytes"], comb_sel_bytes),
        ("combine", "ours_hook", combine_hook, stats["combine_wire_bytes"], comb_sel_bytes),
        ("combine", "ours_collective", combine_coll, stats["combine_wire_bytes"], comb_sel_bytes),
        ("combine", "memcpy_floor", comb_memcpy, comb_bytes, comb_sel_bytes),
        ("combine", "a2a_floor", comb_floor, comb_floor.wire_bytes, comb_sel_bytes),
        ("combine", "allgather_rs", lambda: agrs.combine(*gathered), ag_comb_bytes, comb_sel_bytes),
    ]
    v2_cases, v2_buffer = elastic_cases(group, x, topk_idx, n, e, _selection_bytes(args.hidden, "none", dtype),
                                        comb_sel_bytes)  # fmt: skip
    cases += v2_cases
    records = []
    all_us = time_interleaved([case[2] for case in cases], group, args.warmup, args.iters)
    by_name = {(op, impl): us for (op, impl, *_), us in zip(cases, all_us, strict=True)}
    for (op, impl, _, wire, per_sel), us in zip(cases, all_us, strict=True):
        lat = _stats(us)
        wire_t = torch.tensor([float(wire)])
        dist.all_reduce(wire_t, op=dist.ReduceOp.MAX, group=group)
        records.append(
            {
                "op": op,
                "impl": impl,
                "num_processes": w,
                "num_tokens": n,
                "hidden": args.hidden,
                "num_topk": args.num_topk,
                "num_experts": e,
                "dtype": args.dtype,
                "quant": quant,
                "latency_us": lat,
                "algo_bandwidth_gbps": sel_per_rank * per_sel / (lat["median"] * 1e-6) / 1e9,
                "wire_bytes_per_rank": int(wire_t.item()),
            }
        )
        if impl == "ours":  # same-iteration ratios: robust to load that drifts over the run
            for base in ("memcpy_floor", "ours_collective", "a2a_floor"):
                pairs = zip(us, by_name[op, base], strict=True)
                records[-1][f"paired_ratio_to_{base}"] = statistics.median(a / b for a, b in pairs)
    if args.breakdown:
        profiling.enable()
        for _ in range(args.iters):
            dist.barrier(group=group)
            dispatch()
            dist.barrier(group=group)
            combine()
        breakdown = profiling.report(reset=True)
        profiling.disable()
        records.append({"op": "breakdown", "impl": "ours", "num_processes": w, "rank": rank, "sections_us": breakdown})
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(records, f)
    v2_buffer.destroy()
    coll.destroy()
    buffer.destroy()  # collective: no rank tears the group down while a peer still finishes a collective
    dist.destroy_process_group()


def run(args, retry: bool = True) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"/tmp/bench_ll_{os.getpid()}_{port}.json"
    try:
        mp.spawn(_run_rank, args=(args, port, path), nprocs=args.num_processes, join=True)
    except mp.ProcessExitedException as err:  # seen rarely on a loaded machine (a rank aborting inside gloo)
        if not retry:
            raise
        print(f"# a rank died ({err}); running this configuration again", flush=True)
        return run(args, retry=False)
    with open(path) as f:
        records = json.load(f)
    os.unlink(path)
    return records


def print_table(records: list[dict]) -> None:
    cfg = records[0]
    print(
        f"EP{cfg['num_processes']} tokens={cfg['num_tokens']} hidden={cfg['hidden']} topk={cfg['num_topk']} "
        f"experts={cfg['num_experts']} dtype={cfg['dtype']} quant={cfg['quant']}"
    )
    print(f"{'op':9s} {'impl':13s} {'median us':>10s} {'min us':>9s} {'max us':>9s} {'GB/s':>7s} {'wire B/rank':>12s}")
    floors = {r["op"]: r["latency_us"]["median"] for r in records if r.get("impl") == "a2a_floor"}
    for r in records:
        if r["op"] == "breakdown":
            continue
        lat = r["latency_us"]
        ratio = lat["median"] / floors[r["op"]] if r["op"] in floors else float("nan")
        print(
            f"{r['op']:9s} {r['impl']:13s} {lat['median']:10.1f} {lat['min']:9.1f} {lat['max']:9.1f} "
            f"{r['algo_bandwidth_gbps']:7.2f} {r['wire_bytes_per_rank']:12d}  ({ratio:.2f}x floor)"
        )
    for r in records:
        if r.get("impl") == "ours" and "paired_ratio_to_memcpy_floor" in r:
            ratios = ", ".join(f"/ {b} {r[f'paired_ratio_to_{b}']:.2f}x" for b in ("memcpy_floor", "ours_collective"))
            print(f"{r['op']:9s} ours, same-iteration median ratio: {ratios}")
    for r in records:
        if r["op"] == "breakdown":
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["sections_us"].items())
            print(f"breakdown (rank {r['rank']}, mean us per call): {parts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--num-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--quant", choices=["none", "fp8", "int8"], default="none")
    p.add_argument("--use-fp8", action="store_true", help="same as --quant fp8")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--breakdown", action="store_true", help="also report where our time goes")
    p.add_argument("--transport", choices=["auto", "shm", "collective"], default="auto",
                   help="the transport of 'ours' ('ours_collective' is always the collective one)")  # fmt: skip
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run on this many simulated hosts (root; --num-processes ranks each) against one host: "
        "benchmarks/bench_hosts.py",
    )
    p.add_argument("--sweep", choices=["none", "tokens", "ep"], default="none")
    p.add_argument("--json", help="write all records to this path")
    p.add_argument("--plot", help="write a latency plot (PNG) to this path (needs a sweep)")
    args = p.parse_args()
    if args.use_fp8:
        args.quant = "fp8"
    if args.hosts:
        from benchmarks.bench_hosts import run_hosts

        record = run_hosts(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([record], f, indent=1)
        return
    all_records = []
    if args.sweep == "tokens":
        configs = [dict(num_tokens=t) for t in (1, 8, 32, 128, 256, 512)]
    elif args.sweep == "ep":
        configs = [dict(num_processes=w) for w in (2, 4, 8)]
    else:
        configs = [{}]
    for cfg in configs:
        run_args = argparse.Namespace(**{**vars(args), **cfg})
        records = run(run_args)
        print_table(records)
        print()
        all_records += records
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_records, f, indent=1)
    if args.plot:
        from benchmarks.plot import plot_latency

        plot_latency(all_records, args.sweep, args.plot)


if __name__ == "__main__":
    main()
