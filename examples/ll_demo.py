"""A 2-rank CPU demo: dispatch -> identity experts -> combine with the reference ops, printing what happened.

Run: ``python examples/ll_demo.py`` (spawns 2 gloo ranks on loopback; no accelerator, no downloads).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

NUM_TOKENS, HIDDEN, NUM_EXPERTS, TOPK = 6, 8, 8, 2


def _run(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    x = torch.randn(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS)[:TOPK] for _ in range(NUM_TOKENS)]).to(torch.int32)
    weights = torch.softmax(torch.randn(NUM_TOKENS, TOPK), dim=-1)
    expand_x, _, assist, token_nums, recv_counts, _, _ = moe_distribute_dispatch_v2(
        x, ids, dist.group.WORLD, world_size, rank, NUM_EXPERTS
    )
    num_rows = int(recv_counts[-1])
    triples = assist[: 3 * num_rows].view(-1, 3).tolist()
    lines = [
        f"[rank {rank}] sends {NUM_TOKENS} tokens, top-{TOPK} of {NUM_EXPERTS} experts: {ids.tolist()}",
        f"[rank {rank}] received {num_rows} rows; per local expert: {token_nums.tolist()}",
        f"[rank {rank}] rows as (src rank, src token, top-k slot): {triples}",
    ]
    y = moe_distribute_combine_v2(
        expand_x, ids, assist, recv_counts, weights, dist.group.WORLD, world_size, rank, NUM_EXPERTS
    )  # identity experts: expand_x goes straight back
    expected = (x.float() * weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    err = (y.float() - expected.float()).abs().max().item()
    lines.append(f"[rank {rank}] combine == x * sum(weights): max abs err {err:.3g}")
    for r in range(world_size):
        dist.barrier()
        if r == rank:
            print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
