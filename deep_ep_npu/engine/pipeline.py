"""The MegaMoE pipeline (``docs/mega-moe.md`` draws it): the PTO MegaMoE kernel's stages over a backend's flat
dispatch / combine, per segment of local experts (or of tokens, ``segment_by="token"``), each an independent chain
(its pairs selected by a 2D ``x_active_mask``): dispatch (quant_mode 2 for int8 weights), the expert FFN (:mod:`.ffn`),
combine (the top-k weighted sum in fp32), one final cast. One comm thread issues every collective in the same order
on every rank while the calling thread computes. Expert segments change only the fp32 summation order (at most one
ulp of ``out_dtype``); one segment, or token segments, are bit-equal to the unfused path."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..core.ascend import recv_capacity
from ..core.call import FFN, FlatCombine, FlatDispatch, FusedCall
from ..quant import INT8_PER_TOKEN
from .ffn import grouped_ffn

DISPATCH, COMBINE = "moe_distribute_dispatch_v2", "moe_distribute_combine_v2"


def segments(ffn: FFN) -> int:
    assert ffn.num_segments is not None, "a checked FFN (core.fused.ffn)"
    return ffn.num_segments


def segment_experts(ffn: FFN, s: int, num_local: int) -> range:
    """Local experts computed in segment ``s``: contiguous groups of sizes differing by at most one with
    ``segment_by="expert"``, every local expert with ``"token"``."""
    n = segments(ffn)
    return range(num_local) if ffn.segment_by == "token" else range(s * num_local // n, (s + 1) * num_local // n)


def pair_segments(call: FusedCall, ffn: FFN) -> torch.Tensor:
    """`[M, topK]` `torch.int64`: each pair's segment (-1: not routed), that of its local expert
    (``segment_by="expert"``) or of its token's chunk (``"token"``)."""
    idx, n, num_local = call.expert_ids, segments(ffn), call.experts.num_local
    if ffn.segment_by == "token":
        chunk = torch.arange(idx.shape[0], device=idx.device) * n // max(idx.shape[0], 1)
        return torch.where(idx >= 0, chunk.unsqueeze(1).expand_as(idx), -1)
    segment_of_local = torch.tensor([s for s in range(n) for _ in segment_experts(ffn, s, num_local)])
    return torch.where(idx >= 0, segment_of_local.to(idx.device)[idx.clamp(min=0) % num_local], -1)


def run(backend: Any, call: FusedCall, ffn: FFN, expert_token_nums: torch.Tensor | None = None) -> torch.Tensor:
    """Run the pipelined dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine of a validated fused call on ``backend``
    (its flat dispatch / combine); returns `[M, K]` with ``ffn.out_dtype``. Tokens outside the call's mask carry only
    -1 ids (validation), so they are not dispatched and their rows are 0. ``expert_token_nums`` (`[L]` integer,
    optional) is set to the rows each local expert received."""
    e, ids, n, x = call.experts, call.expert_ids, segments(ffn), call.x
    out_dtype, limit = ffn.out_dtype, ffn.swiglu_limit
    assert out_dtype is not None and limit is not None, "a checked FFN (core.fused.ffn)"
    global_bs = call.num_max * e.world_size
    segment = pair_segments(call, ffn)
    capacity = recv_capacity(e, global_bs, ids.shape[1])
    masks = [segment == s for s in range(n)]
    quant = INT8_PER_TOKEN if ffn.w1_scale is not None else None
    dispatch = [
        FlatDispatch(
            DISPATCH,
            x,
            ids,
            e,
            num_max=call.num_max,
            global_bs=global_bs,
            x_active_mask=m,
            quant=quant,
            capacity=capacity,
        )
        for m in masks
    ]
    # expert segments' partial sums travel in fp32 (one rounding at the end); one segment is the whole sum already
    wire_dtype = torch.float32 if ffn.segment_by == "expert" and n > 1 else out_dtype
    weights = (ffn.w1, ffn.w2, ffn.w1_scale, ffn.w2_scale)

    def receive(start: Future) -> Any:  # finishes an op whose send phase ran earlier on the same comm thread
        return start.result().wait()

    comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mega_moe_comm")
    try:
        # comm order: D0 D1 T0 D2 T1 ..., so segment 0's rows arrive after two send phases while later payloads fly
        # (at most two calls in flight: what a shared-memory window's two halves hold)
        sent: list = [comm.submit(backend.dispatch, dispatch[0])]
        received: list = []
        for s in range(n):
            sent += [comm.submit(backend.dispatch, dispatch[s + 1])] if s + 1 < n else []
            received.append(comm.submit(receive, sent[s]))
        combines, partials = [], []
        for s in range(n):
            expand_x, scales, assist, token_nums, counts, _, _ = received[s].result()
            received[s] = sent[s] = None  # free the receive buffers early
            if expert_token_nums is not None:
                expert_token_nums.copy_(token_nums if s == 0 else expert_token_nums + token_nums)
            y = grouped_ffn(
                expand_x,
                scales,
                token_nums,
                segment_experts(ffn, s, e.num_local),
                *weights,
                out_dtype,
                limit,
            )
            num_rows = int(counts[e.world_size * e.num_local - 1])
            combine = FlatCombine(
                COMBINE,
                y.to(wire_dtype),
                ids,
                e,
                (assist, counts, None),
                x_active_mask=masks[s],
                expert_scales=call.expert_scales,
                global_bs=global_bs,
                num_rows=num_rows,
            )
            combines.append(comm.submit(backend.combine, combine))
            if s:  # C0 C1 R0 C2 R1 ...: again at most two calls in flight
                partials.append(comm.submit(receive, combines[s - 1]))
        partials.append(comm.submit(receive, combines[-1]))
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        for partial in partials:  # token segments: each row is nonzero in one segment only (exact)
            out += partial.result().float()
    finally:
        comm.shutdown(wait=True, cancel_futures=True)
    return out.to(out_dtype)
