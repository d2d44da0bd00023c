"""The ``ascend`` backend's MegaMoE: a fused call on vllm-ascend's fused op ``torch.ops._C_ascend.dispatch_ffn_combine``
(aclnn ``DispatchFFNCombine`` / ``...BF16``; when it applies and how scales are passed: ``docs/mega-moe.md``).
Keywords only (an older schema without ``bias1/2`` fails loudly rather than shifts); ``swiglu_limit`` 0.0 is no clamp
(the schema's default 1e6 clamps at 1e6). NPU parity is not tested."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..core.call import FFN, FusedCall

HIDDEN_ALIGN, INTERMEDIATE_ALIGN = 128, 64  # the A5 PTO MegaMoE kernel's tiling: K % 128 == 0, N % 64 == 0
FUSED_X_DTYPES = (torch.bfloat16, torch.float16)  # the op's x / out dtypes (out is x's)


def fixpipe_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 per-channel scales -> the op's int64 Fixpipe words (fp32 bits as int32, sign-extended), same shape."""
    return scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def fixpipe_scale_value(words: torch.Tensor) -> torch.Tensor:
    """The fp32 scales that int64 Fixpipe ``words`` hold (the low 32 bits; exact inverse of :func:`fixpipe_scale`)."""
    return words.to(torch.int32).contiguous().view(torch.float32)


def fused_op_blocker(call: FusedCall, ffn: FFN) -> str | None:
    """Why this call cannot use the fused op (None if it can)."""
    x, wdt, mask = call.x.dtype, ffn.w1.dtype, call.x_active_mask
    if x not in FUSED_X_DTYPES:
        return f"x is {x}; the fused op takes {[str(d) for d in FUSED_X_DTYPES]}"
    if ffn.out_dtype != x:
        return f"out_dtype {ffn.out_dtype} differs from x's {x}; the fused op writes out in x's dtype"
    if wdt != torch.int8 and wdt != x:
        return f"weights are {wdt}; the fused op takes int8 weights or weights of x's dtype {x}"
    if call.x.shape[1] % HIDDEN_ALIGN:
        return f"K = {call.x.shape[1]} is not a multiple of {HIDDEN_ALIGN}"
    if ffn.w2.shape[1] % INTERMEDIATE_ALIGN:
        return f"N = {ffn.w2.shape[1]} is not a multiple of {INTERMEDIATE_ALIGN}"
    if call.expert_ids.shape[1] > call.experts.num_moe_experts:
        return f"topK = {call.expert_ids.shape[1]} exceeds the {call.experts.num_moe_experts} experts"
    if wdt != torch.int8 and (mask is not None or callable(ffn.swiglu_limit) or (ffn.swiglu_limit or 0.0) > 0):
        return "the fused op's float-weight kernel ignores x_active_mask and swiglu_limit"
    return None


def route_no_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[M, topK]` int64 ``ids`` (-1: no expert, topK <= ``num_experts``) with each -1 replaced by an expert the row
    does not list (the n-th -1 of a row by the n-th such expert), on the device: the fused op routes every pair."""
    none = ids < 0
    listed = torch.zeros((ids.shape[0], num_experts), dtype=torch.int32, device=ids.device)
    listed.scatter_add_(1, ids.clamp(min=0), (~none).to(torch.int32))
    free_so_far = (listed == 0).to(torch.int64).cumsum(1)  # `[M, E]`: unlisted experts up to each id
    nth = none.to(torch.int64).cumsum(1)  # `[M, topK]`: the slot's rank among the row's -1 (from 1)
    return torch.where(none, torch.searchsorted(free_so_far, nth), ids)


def fused_op_kwargs(
    call: FusedCall, ffn: FFN, group_name: str, prepare_weight: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """The keyword arguments of one fused-op call: one-item weight lists in the op's format, int32 ids; a -1 (no
    expert) goes to an expert the token does not list, with weight 0 (:func:`route_no_expert`: it adds 0, unless
    that expert's output for the token is not finite)."""
    x, dev = call.x, call.x.device
    probs = call.expert_scales.masked_fill(call.expert_ids < 0, 0.0)
    ids = route_no_expert(call.expert_ids, call.experts.num_moe_experts).to(torch.int32)
    no_scale, no_bias = ([torch.empty((0,), dtype=dt, device=dev)] for dt in (torch.int64, torch.float32))
    scale1, scale2 = no_scale, no_scale
    if ffn.w1_scale is not None and ffn.w2_scale is not None:
        scale1, scale2 = [fixpipe_scale(ffn.w1_scale.to(dev))], [fixpipe_scale(ffn.w2_scale.to(dev))]
    return dict(
        x=x,
        weight1=[prepare_weight(ffn.w1.to(dev))],
        weight2=[prepare_weight(ffn.w2.to(dev))],
        expert_idx=ids,
        scale1=scale1,
        scale2=scale2,
        bias1=no_bias,
        bias2=no_bias,
        probs=probs,
        group=group_name,
        max_output_size=ffn.max_output_size,
        out=torch.empty(tuple(x.shape), dtype=x.dtype, device=dev),
        expert_token_nums=torch.zeros((call.experts.num_local,), dtype=torch.int32, device=dev),
        x_active_mask=call.x_active_mask,
        swiglu_limit=ffn.swiglu_limit,
    )


def fused_mega_moe(ops: Any, group: dist.ProcessGroup, rank: int, call: FusedCall, ffn: FFN) -> torch.Tensor:
    """One fused-op call (``ops``: the backend's, holding the op, the comm name and the weight cast)."""
    kwargs = fused_op_kwargs(call, ffn, ops.group_name(group, rank), ops.prepare_weight)
    ops.fused_op(**kwargs)
    return kwargs["out"].to(ffn.out_dtype)
