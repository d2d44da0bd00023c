"""Normal-mode (prefill) dispatch + combine benchmark: ``Buffer.dispatch`` / ``combine`` (DeepEP's normal mode) vs the
memcpy floor of the bytes it moves and vs ``ElasticBuffer`` (DeepEP V2) doing the same job, in the same run.

Every implementation runs in the same process group, on the same data, interleaved (each iteration runs every one,
in a random order, barrier-aligned; latency is the max over ranks):

- ``ours``: ``get_dispatch_layout`` + ``dispatch`` (top-k, weights) + ``combine`` (with the received weights) on
  ``Buffer`` (the shared-memory window on one host with ``--transport auto``);
- ``ours_cached``: ``dispatch(x, handle=...)`` + ``combine``: the cached layout engines use for a layer's second call;
- ``elastic``: ``ElasticBuffer.dispatch`` (non-expand, CPU sync: DeepEP V2's prefill form) + ``combine``;
- ``memcpy_floor``: every rank at once copies the bytes the op moves, once (dispatch: the received rows; combine:
  the rows sent back), with one ``copy_``.

We report median / min / max latency, the DeepEP-style bandwidth (received bf16 rows x 2 directions / latency) and
the same-iteration median ratios of ``ours`` to ``memcpy_floor`` and to ``elastic``.

    python benchmarks/bench_normal.py --num-processes 2 --num-tokens 4096 --hidden 4096 --num-topk 8 \\
        --num-experts 64 --json out.json
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

from benchmarks.baselines import MemcpyFloor  # noqa: E402
from benchmarks.timing import time_interleaved  # noqa: E402
from deep_ep_npu import Buffer, ElasticBuffer  # noqa: E402


def _run_rank(rank: int, args, port: int, results_path: str) -> None:
    torch.set_num_threads(1)
    w = args.num_processes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=w)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1234 + rank)
    n, e = args.num_tokens, args.num_experts
    x = (torch.randn(n, args.hidden, generator=gen) * 0.1).to(torch.bfloat16)
    scores = torch.randn(n, e, generator=gen).abs() + 1
    topk_idx = torch.topk(scores, args.num_topk, dim=-1).indices
    topk_weights = torch.rand(n, args.num_topk, generator=gen)
    buffer = Buffer(group, explicitly_destroy=True, transport=args.transport)
    v2 = ElasticBuffer(group, num_max_tokens_per_rank=n, explicitly_destroy=True)

    def ours() -> object:
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, e)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        return buffer.combine(recv_x, handle, topk_weights=recv_w)

    layout = buffer.get_dispatch_layout(topk_idx, e)
    first = buffer.dispatch(
        x,
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    handle = first[4]

    def ours_cached() -> object:
        recv_x = buffer.dispatch(x, handle=handle)[0]
        return buffer.combine(recv_x, handle)

    def elastic() -> object:
        recv_x, _, recv_w, h, _ = v2.dispatch(x, topk_idx, topk_weights, num_experts=e)
        return v2.combine(recv_x, h, topk_weights=recv_w)

    moved = 2 * first[0].shape[0] * args.hidden * 2  # received rows, then the same rows sent back
    floor = MemcpyFloor(moved)
    cases = [("ours", ours), ("ours_cached", ours_cached), ("elastic", elastic), ("memcpy_floor", floor)]
    all_us = time_interleaved([fn for _, fn in cases], group, args.warmup, args.iters)
    by_name = {name: us for (name, _), us in zip(cases, all_us, strict=True)}
    moved_t = torch.tensor([float(moved)])
    dist.all_reduce(moved_t, op=dist.ReduceOp.MAX, group=group)
    records = []
    for name, us in by_name.items():
        med = statistics.median(us)
        record = {
            "op": "dispatch+combine",
            "impl": name,
            "num_processes": w,
            "num_tokens": n,
            "hidden": args.hidden,
            "num_topk": args.num_topk,
            "num_experts": e,
            "dtype": "bf16",
            "transport": args.transport,
            "latency_us": {"median": med, "min": min(us), "max": max(us)},
            "moved_bytes_per_rank": int(moved_t.item()),
            "bandwidth_gbps": moved_t.item() / (med * 1e-6) / 1e9,
        }
        if name in ("ours", "ours_cached"):
            for base in ("memcpy_floor", "elastic"):
                record[f"paired_ratio_to_{base}"] = statistics.median(
                    a / b for a, b in zip(us, by_name[base], strict=True)
                )
        records.append(record)
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(records, f)
    v2.destroy()
    buffer.destroy()
    dist.destroy_process_group()


def run(args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"/tmp/bench_normal_{os.getpid()}_{port}.json"
    mp.spawn(_run_rank, args=(args, port, path), nprocs=args.num_processes, join=True)
    with open(path) as f:
        records = json.load(f)
    os.unlink(path)
    return records


def print_table(records: list[dict]) -> None:
    cfg = records[0]
    print(
        f"EP{cfg['num_processes']} tokens={cfg['num_tokens']} hidden={cfg['hidden']} topk={cfg['num_topk']} "
        f"experts={cfg['num_experts']} bf16, transport={cfg['transport']}, "
        f"moved {cfg['moved_bytes_per_rank'] / 1e6:.1f} MB/rank"
    )
    print(f"{'impl':13s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'GB/s':>7s}  same-iteration ratios")
    for r in records:
        lat = r["latency_us"]
        ratios = ", ".join(
            f"/ {b} {r[f'paired_ratio_to_{b}']:.2f}x"
            for b in ("memcpy_floor", "elastic")
            if f"paired_ratio_to_{b}" in r
        )
        print(
            f"{r['impl']:13s} {lat['median'] / 1e3:10.2f} {lat['min'] / 1e3:9.2f} {lat['max'] / 1e3:9.2f} "
            f"{r['bandwidth_gbps']:7.2f}  {ratios}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--transport", choices=["auto", "shm", "collective"], default="auto")
    p.add_argument("--json", help="write the records to this path")
    args = p.parse_args()
    records = run(args)
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
