"""torch_npu MoE code without an NPU: ``moe_layer`` is written against torch_npu (as vllm-ascend calls it) and runs
here on ``deep_ep_npu.sim``'s stand-in, in 2 gloo processes on CPU tensors.

Run: ``python examples/sim_torch_npu.py`` (no accelerator, no downloads). On an Ascend machine, drop ``sim.install()``
and move the tensors to the NPU: ``moe_layer`` stays as it is.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_TOKENS, HIDDEN, NUM_EXPERTS, TOPK = 4, 16, 8, 2


def moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, group: dist.ProcessGroup,
              num_experts: int, max_tokens_per_rank: int) -> torch.Tensor:  # fmt: skip
    """x `[T, H]` bf16, topk_ids `[T, K]` int32, topk_weights `[T, K]` fp32 -> `[T, H]` bf16: each token's top-k
    experts (expert e multiplies by e + 1) weighted and summed, via torch_npu's MC2 dispatch / combine. T may differ
    across ranks, up to ``max_tokens_per_rank`` (so ``global_bs`` is that times the world size)."""
    import torch_npu  # the real one on an NPU; deep_ep_npu.sim's stand-in after sim.install()

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    group_ep = group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
    global_bs = max_tokens_per_rank * world_size
    expand_x, _, assist_info, expert_token_nums, ep_recv_counts, _, expand_scales = (
        torch_npu.npu_moe_distribute_dispatch_v2(
            x=x, expert_ids=topk_ids, group_ep=group_ep, ep_world_size=world_size, ep_rank_id=rank,
            moe_expert_num=num_experts, expert_shard_type=0, shared_expert_rank_num=0, quant_mode=0,
            global_bs=global_bs, expert_token_nums_type=1,
        )
    )  # fmt: skip
    # rows are grouped per local expert; expert_token_nums (counts) is the grouped matmul's group_list
    expert_out, start = torch.zeros_like(expand_x), 0
    for local, count in enumerate(expert_token_nums.tolist()):
        expert = rank * (num_experts // world_size) + local
        expert_out[start : start + count] = expand_x[start : start + count] * (expert + 1)
        start += count
    return torch_npu.npu_moe_distribute_combine_v2(
        expand_x=expert_out, expert_ids=topk_ids, assist_info_for_combine=assist_info, ep_send_counts=ep_recv_counts,
        expert_scales=topk_weights.to(torch.float32), group_ep=group_ep, ep_world_size=world_size, ep_rank_id=rank,
        moe_expert_num=num_experts, global_bs=global_bs, expand_scales=expand_scales,
    )  # fmt: skip


def _run(rank: int, world_size: int, port: int) -> None:
    from deep_ep_npu import sim

    sim.install()  # before anything imports torch_npu
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((NUM_TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(NUM_TOKENS)]).to(torch.int32)
    weights = torch.softmax(torch.randn((NUM_TOKENS, TOPK), generator=g), dim=-1)
    y = moe_layer(x, ids, weights, dist.group.WORLD, NUM_EXPERTS, NUM_TOKENS)
    expected = ((x.float()[:, None] * (ids[:, :, None] + 1)).to(torch.bfloat16).float() * weights[:, :, None]).sum(1)
    err = (y.float() - expected.to(torch.bfloat16).float()).abs().max().item()
    for r in range(world_size):
        dist.barrier()  # also keeps every rank alive until the last combine is done
        if r == rank:
            print(f"[rank {rank}] experts {ids.tolist()} -> y {tuple(y.shape)} {y.dtype}, max err vs oracle {err}")
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
