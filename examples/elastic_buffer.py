"""DeepEP V2's ``ElasticBuffer`` on 2 CPU ranks: a prefill-style dispatch (exact shapes), experts that scale their
rows, a weighted combine, then decode steps that reuse the cached handle (no count exchange) and the expand layout.

Run: ``python examples/elastic_buffer.py`` (spawns 2 gloo ranks on loopback; no accelerator, no downloads).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deep_ep_npu import ElasticBuffer

NUM_MAX_TOKENS, HIDDEN, NUM_EXPERTS, TOPK = 8, 128, 8, 2


def _run(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=NUM_MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                           explicitly_destroy=True)  # fmt: skip
    num_local = NUM_EXPERTS // world_size
    x = torch.randn(NUM_MAX_TOKENS - rank, HIDDEN).to(torch.bfloat16)
    topk_weights, topk_idx = torch.softmax(torch.randn(x.shape[0], NUM_EXPERTS), -1).topk(TOPK, dim=-1)

    # prefill: exact shapes; one row per (token, this rank), local expert ids (-1: another rank's)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(
        x, topk_idx, topk_weights, num_experts=NUM_EXPERTS
    )
    scale = 1.0 + torch.arange(num_local) + rank * num_local  # local expert i multiplies by its global id + 1
    local = recv_topk_idx >= 0
    factor = (recv_topk_weights * scale[recv_topk_idx.clamp(min=0)] * local).sum(dim=1, keepdim=True)
    combined_x, _, _ = buffer.combine((recv_x.float() * factor).to(torch.bfloat16), handle)  # rows are pre-weighted
    want = x.float() * (topk_weights * (1.0 + topk_idx)).sum(dim=1, keepdim=True)
    lines = [
        f"[rank {rank}] received {recv_x.shape[0]} tokens; per source rank (psum): "
        f"{handle.psum_num_recv_tokens_per_scaleup_rank.tolist()}, per local expert: "
        f"{handle.num_recv_tokens_per_expert_list}",
        f"[rank {rank}] combine vs sum_k w * (e + 1) * x: max abs err "
        f"{(combined_x.float() - want).abs().max().item():.3g}",
    ]

    # decode: the same routing, new activations; the cached handle skips the count exchange
    for step in range(2):
        step_x = (x.float() * (step + 2)).to(torch.bfloat16)
        recv_step, *_ = buffer.dispatch(step_x, handle=handle)
        same = torch.equal(recv_step, (recv_x.float() * (step + 2)).to(torch.bfloat16))
        lines.append(f"[rank {rank}] cached step {step}: rows at the same positions: {same}")

    # expand layout: one row per (token, local expert), each expert's segment aligned to 4 rows
    exp_x, _, exp_w, exp_handle, _ = buffer.dispatch(
        x, topk_idx, topk_weights, num_experts=NUM_EXPERTS, do_expand=True, expert_alignment=4, do_zero_padding=True
    )
    lines.append(f"[rank {rank}] expand: {exp_x.shape[0]} rows, psum per expert "
                 f"{exp_handle.psum_num_recv_tokens_per_expert.tolist()}")  # fmt: skip
    for r in range(world_size):
        dist.barrier()
        if r == rank:
            print("\n".join(lines), flush=True)
    buffer.destroy()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
