"""The reference MegaMoE pipeline: the A5 PTO MegaMoE kernel's stages over the two-stage ops, per segment.

Kernel stages here: FrontReorder + Dispatch = dispatch (quant_mode 2 for int8 weights), GMM1/SwiGLU/GMM2 =
:mod:`.ffn` per local expert, Combine + Unpermute = combine (top-k weighted sum in fp32), then one final cast. The
local experts are split into S contiguous segments (the same on every rank); segment k's dispatch carries only the
pairs whose expert is in segment k (a 2D ``x_active_mask``), so segments are independent chains. As the kernel
splits AIV (communication) from AIC (GMMs), one comm thread issues every collective, in the same order on every
rank, while the calling thread only computes:

```
comm thread : [D0][D1] T0 [D2] T1 [D3] T2 T3 ........ [C0] ........ [C1] R0 ..... [C2] R1 ..... [C3] R2 R3
compute     :             |  FFN seg 0  |  FFN seg 1  |  FFN seg 2  |  FFN seg 3  |                  sum -> out
                           ^ rows of seg 0 (T0)        ^ C0 starts as soon as FFN seg 0 is done
```

``Dk`` / ``Ck``: the send phase of segment k's dispatch / combine (validation, the agreement step, the payload
started asynchronously); ``Tk`` / ``Rk``: their receive phases. Expert outputs are rounded to ``out_dtype`` (as the
kernel's FP16 CV tiles); expert segments' fp32 partials differ from one unsegmented combine by fp32 re-association
(at most one ulp of ``out_dtype``); one segment sends ``out_dtype`` rows and is bit-equal to the unfused path, as is
``segment_by="token"``, which costs S smaller GEMMs per expert.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..engine.flat import start_combine_flat, start_dispatch_flat
from ..params import CombineParams, DispatchParams
from .ffn import grouped_ffn
from .params import MegaMoeArgs


def pair_segments(args: MegaMoeArgs) -> torch.Tensor:
    """`[M, topK]` `torch.int64`: each pair's segment (-1: not routed), that of its local expert
    (``segment_by="expert"``) or of its token's chunk (``"token"``)."""
    idx = args.topk_idx
    if args.segment_by == "token":
        chunk = torch.arange(args.num_tokens, device=idx.device) * args.num_segments // max(args.num_tokens, 1)
        return torch.where(idx >= 0, chunk.unsqueeze(1).expand_as(idx), -1)
    segment_of_local = torch.tensor([s for s in range(args.num_segments) for _ in args.segment_experts(s)])
    return torch.where(idx >= 0, segment_of_local.to(idx.device)[idx.clamp(min=0) % args.num_local_experts], -1)


def run_reference(args: MegaMoeArgs, expert_token_nums: torch.Tensor | None = None) -> torch.Tensor:
    """Run the pipelined dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine; returns `[M, K]` with ``args.out_dtype``.
    Tokens outside ``args.x_active_mask`` carry only -1 ids (validation), so they are not dispatched and their rows
    are 0. ``expert_token_nums`` (`[L]` integer, optional) is set to the rows each local expert received."""
    ids, segment, n, ep = args.topk_idx, pair_segments(args), args.num_segments, args.ep
    global_bs = args.num_max_dispatch_tokens_per_rank * args.world_size
    common: dict[str, Any] = dict(group_ep=args.group, ep_world_size=args.world_size, ep_rank_id=args.rank,
                                  moe_expert_num=args.num_experts, global_bs=global_bs, no_expert=True)  # fmt: skip
    masks = [segment == s for s in range(n)]
    dispatch = [DispatchParams(args.x, ids, x_active_mask=m, quant_mode=2 if args.int8_weights else 0,
                               expert_token_nums_type=1, **common) for m in masks]  # fmt: skip
    # expert segments' partial sums travel in fp32 (one rounding at the end); one segment is the whole sum already
    wire_dtype = torch.float32 if args.segment_by == "expert" and n > 1 else args.out_dtype
    weights = (args.w1, args.w2, args.w1_scale, args.w2_scale)

    def receive(start: Future) -> Any:  # finishes an op whose send phase ran earlier on the same comm thread
        return start.result().wait()

    comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mega_moe_comm")
    tr = args.transport
    try:
        # comm order: D0 D1 T0 D2 T1 ..., so segment 0's rows arrive after two send phases while later payloads fly
        # (at most two calls in flight: what a shared-memory window's two halves hold)
        sent: list = [comm.submit(start_dispatch_flat, dispatch[0], ep, None, tr)]
        received: list = []
        for s in range(n):
            sent += [comm.submit(start_dispatch_flat, dispatch[s + 1], ep, None, tr)] if s + 1 < n else []
            received.append(comm.submit(receive, sent[s]))
        combines, partials = [], []
        for s in range(n):
            expand_x, scales, assist, token_nums, counts, _, _ = received[s].result()
            received[s] = sent[s] = None  # free the receive buffers early
            if expert_token_nums is not None:
                expert_token_nums.copy_(token_nums if s == 0 else expert_token_nums + token_nums)
            y = grouped_ffn(expand_x, scales, token_nums, args.segment_experts(s), *weights, args.out_dtype,
                            args.swiglu_limit)  # fmt: skip
            p = CombineParams(
                y.to(wire_dtype), ids, assist, counts, args.topk_weights, x_active_mask=masks[s], **common
            )
            combines.append(comm.submit(start_combine_flat, p, ep, None, tr))
            if s:  # C0 C1 R0 C2 R1 ...: again at most two calls in flight
                partials.append(comm.submit(receive, combines[s - 1]))
        partials.append(comm.submit(receive, combines[-1]))
        out = torch.zeros((args.num_tokens, args.hidden), dtype=torch.float32, device=args.x.device)
        for partial in partials:  # token segments: each row is nonzero in one segment only (exact)
            out += partial.result().float()
    finally:
        comm.shutdown(wait=True, cancel_futures=True)
    return out.to(args.out_dtype)
