"""The reference MegaMoE pipeline: the A5 PTO MegaMoE kernel's stages over the two-stage ops, per segment.

Kernel stages here: FrontReorder + Dispatch = dispatch (quant_mode 2 for int8 weights), GMM1/SwiGLU/GMM2 =
:mod:`.ffn` per local expert, Combine + Unpermute = combine (top-k weighted sum in fp32), then one final cast. The
local experts are split into S contiguous segments (the same on every rank); segment k's dispatch carries only the
pairs whose expert is in segment k (a 2D ``x_active_mask``), so segments are independent chains. As the kernel
splits AIV (communication) from AIC (GMMs), one comm thread issues every collective, in the same order on every
rank, while the calling thread only computes:

```
comm thread : [D0][D1] T0 [D2] T1 [D3] T2 T3 ........ [C0] ........ [C1] ........ [C2] ........ [C3]  R0 R1 R2 R3
compute     :             |  FFN seg 0  |  FFN seg 1  |  FFN seg 2  |  FFN seg 3  |                  sum -> out
                           ^ rows of seg 0 (T0)        ^ C0 starts as soon as FFN seg 0 is done
```

``Dk`` / ``Ck``: the send phase of segment k's dispatch / combine (validation, the agreement step, the payload
started asynchronously); ``Tk`` / ``Rk``: their receive phases. Expert outputs are rounded to ``out_dtype`` (as the
kernel's FP16 CV tiles), sent as fp32 and the S partials summed in fp32, so the result equals one unsegmented combine up to fp32
re-association (at most one ulp of ``out_dtype``). ``segment_by="token"``: segment k = the k-th chunk of each rank's
tokens (all experts), so rows are final, travel in ``out_dtype`` (half the bytes) and the result is bit-equal to one
dispatch -> FFN -> combine, at the price of S smaller GEMMs per expert.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..engine.flat import start_combine_flat, start_dispatch_flat
from ..event import Completion
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
    n = args.num_segments
    segment_of_local = torch.tensor([s for s in range(n) for _ in args.segment_experts(s)], device=idx.device)
    return torch.where(idx >= 0, segment_of_local[idx.clamp(min=0) % args.num_local_experts], -1)


def run_reference(args: MegaMoeArgs) -> torch.Tensor:
    """Run the pipelined dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine; returns `[M, K]` with ``args.out_dtype``."""
    ids, segment = args.topk_idx, pair_segments(args)
    global_bs = args.num_max_dispatch_tokens_per_rank * args.world_size
    common: dict[str, Any] = dict(group_ep=args.group, ep_world_size=args.world_size, ep_rank_id=args.rank,
                                  moe_expert_num=args.num_experts, global_bs=global_bs, no_expert=True)  # fmt: skip
    masks = [segment == s for s in range(args.num_segments)]
    # expert segments return partial sums of a token's pairs, so they travel in fp32 and are rounded once at the
    # end; token segments return final rows, so they travel in out_dtype (bit-equal to one unsegmented combine)
    wire_dtype = torch.float32 if args.segment_by == "expert" else args.out_dtype
    weights = (args.w1, args.w2, args.w1_scale, args.w2_scale)

    def start_dispatch(s: int) -> Completion:
        kw = dict(x_active_mask=masks[s], quant_mode=2 if args.int8_weights else 0, expert_token_nums_type=1, **common)
        return start_dispatch_flat(DispatchParams(args.x, ids, **kw), args.ep)

    def start_combine(s: int, y: torch.Tensor, assist: torch.Tensor, counts: torch.Tensor) -> Completion:
        p = CombineParams(y.to(wire_dtype), ids, assist, counts, args.topk_weights, x_active_mask=masks[s], **common)
        return start_combine_flat(p, args.ep)

    # One comm thread issues every collective, in the same order on every rank; this thread only computes.
    comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mega_moe_comm")
    try:
        # comm order: D0 D1 T0 D2 T1 ..., so segment 0's rows arrive after two send phases while later payloads fly
        dispatches: list = [comm.submit(start_dispatch, 0)]
        received: list = []
        for s in range(1, args.num_segments + 1):
            dispatches += [comm.submit(start_dispatch, s)] if s < args.num_segments else []
            received.append(comm.submit(_receive, dispatches[s - 1]))
        combines = []
        for s in range(args.num_segments):
            expand_x, scales, assist, token_nums, recv_counts, _, _ = received[s].result()
            received[s] = dispatches[s] = None  # free the receive buffers early
            y = grouped_ffn(expand_x, scales, token_nums, args.segment_experts(s), *weights, args.out_dtype)
            combines.append(comm.submit(start_combine, s, y, assist, recv_counts))
        partials = [comm.submit(_receive, c) for c in combines]
        out = torch.zeros((args.num_tokens, args.hidden), dtype=torch.float32, device=args.x.device)
        for p in partials:
            out += p.result().float()  # type: ignore[attr-defined]  # token segments: each row is nonzero in one segment only (exact)
    finally:
        comm.shutdown(wait=True, cancel_futures=True)
    return out.to(args.out_dtype)


def _receive(start: Future) -> object:
    """Finish an op whose send phase ran as an earlier task on the same comm thread."""
    return start.result().wait()
