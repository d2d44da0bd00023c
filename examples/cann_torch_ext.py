"""Code written against CANN's torch extension (``cann_ops_transformer``), run without an NPU: ``moe_layer`` uses
``MoeDistributeBuffer`` (the V3 context ops) as vllm-ascend's V3 adapter does, ``elastic_layer`` CANN's own
``ElasticBuffer``, ``fused_layer`` ``mega_moe``; here on ``deep_ep_npu.sim``'s stand-in, 2 gloo processes, CPU tensors.

Run: ``python examples/cann_torch_ext.py`` (no accelerator, no downloads). On an Ascend machine with CANN's extension,
drop ``sim.install()`` and move the tensors to the NPU: the three layers stay as they are.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, INTER, EXPERTS, TOPK = 4, 1024, 64, 4, 2


def moe_layer(buffer, x, topk_ids, topk_weights, experts_here: range):
    """dispatch -> each local expert scales its rows by (expert + 1) -> combine (weighted at the source)."""
    expand_x, _, assist_info, expert_token_nums, ep_recv_counts, expand_scales = buffer.low_latency_dispatch(
        x, topk_ids, EXPERTS, num_max_dispatch_tokens_per_rank=TOKENS
    )
    expert_out, start = torch.zeros_like(expand_x), 0
    for expert, count in zip(experts_here, expert_token_nums.tolist(), strict=True):
        expert_out[start : start + count] = expand_x[start : start + count] * (expert + 1)
        start += count
    return buffer.low_latency_combine(
        expert_out,
        topk_ids,
        topk_weights,
        assist_info,
        ep_recv_counts,
        num_experts=EXPERTS,
        num_max_dispatch_tokens_per_rank=TOKENS,
        expand_scales=expand_scales,
    )


def elastic_layer(buffer, x, topk_ids, topk_weights, experts_here: range):
    """CANN's ElasticBuffer: rows per (token, local expert); combine sums them unweighted, echoing the weights."""
    recv_x, _, recv_weights, handle = buffer.dispatch(
        x, topk_idx=topk_ids, topk_weights=topk_weights, num_experts=EXPERTS
    )
    rows = torch.repeat_interleave(torch.tensor(list(experts_here)), handle.num_recv_tokens_per_expert)
    weighted = recv_x.float() * (rows[:, None] + 1) * recv_weights[:, None]  # the expert applies the weight
    combined_x, combined_weights = buffer.combine(weighted.bfloat16(), handle, topk_weights=recv_weights)
    return combined_x, combined_weights


def demo(group: dist.ProcessGroup) -> str:
    """The three layers on this rank's tokens, each checked against the oracle; returns this rank's line."""
    from cann_ops_transformer.ops import ElasticBuffer, MoeDistributeBuffer, get_symm_buffer_for_mega_moe, mega_moe

    rank, local = dist.get_rank(group), EXPERTS // dist.get_world_size(group)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((TOKENS, HIDDEN), generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)]).int()
    weights = torch.softmax(torch.randn((TOKENS, TOPK), generator=g), dim=-1)
    here = range(rank * local, (rank + 1) * local)
    oracle = ((x.float()[:, None] * (ids[:, :, None] + 1)).bfloat16().float() * weights[:, :, None]).sum(1)

    y = moe_layer(MoeDistributeBuffer(group), x, ids, weights, here)
    elastic = ElasticBuffer(group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK)
    y2, echoed = elastic_layer(elastic, x, ids, weights, here)
    elastic.destroy()
    w1 = torch.randn((EXPERTS, HIDDEN, 2 * INTER), generator=torch.Generator().manual_seed(9)).bfloat16() / 32
    w2 = torch.randn((EXPERTS, INTER, HIDDEN), generator=torch.Generator().manual_seed(8)).bfloat16() / 8
    symm = get_symm_buffer_for_mega_moe(group, EXPERTS, TOKENS, TOPK, HIDDEN, INTER)
    y3, expert_token_nums = mega_moe(
        x, ids, weights, list(w1[here.start : here.stop]), list(w2[here.start : here.stop]), symm, activation="swiglu"
    )
    err, err2 = ((t.float() - oracle.bfloat16().float()).abs().max().item() for t in (y, y2))
    return (
        f"[rank {rank}] low_latency: max err vs oracle {err:.3g}; ElasticBuffer: {err2:.3g}, weights echoed "
        f"{torch.equal(echoed, weights)}; mega_moe: y {tuple(y3.shape)}, expert_token_nums "
        f"{expert_token_nums.tolist()}"
    )


def _run(rank: int, world_size: int, port: int) -> None:
    from deep_ep_npu import sim

    sim.install()  # before anything imports torch_npu / cann_ops_transformer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    line = demo(dist.group.WORLD)
    for r in range(world_size):
        dist.barrier()  # also keeps every rank alive until the last call is done
        if r == rank:
            print(line)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
