"""CANN ops-transformer's ``mega_moe`` and ``get_symm_buffer_for_mega_moe``
(https://github.com/cannmirror/ops-transformer/blob/25fb6b9/torch_extension/cann_ops_transformer/ops/mega_moe.py) on the
MegaMoE pipeline (:mod:`deep_ep_npu.mega_moe`; numerics :mod:`deep_ep_npu.engine.ffn`). Weights: A16W16 (bf16 / fp16,
``dispatch_quant_mode`` 0); A8W8-INT (int8 with uint64 Fixpipe scales whose low 32 bits are the fp32 per-channel scale,
``dispatch_quant_mode`` 2); A8W4-INT (int4, 8 per int32 with the lowest nibble first, ND layout as ``npu_format_cast``
leaves it here; its ``l*_bias``, the kernel's ``8 * colsum(W)`` compensation for splitting the int8 activation, is not
needed: the int8 x int4 products are exact); Ascend 950's A8W8-FP (fp8 `[E/W, out, in]` with e8m0 scales per 32 inputs,
``dispatch_quant_mode`` 4: x and the activation output MX-quantized to ``dispatch_quant_out_dtype`` and back, GMMs in
fp32). fp4 weights are refused (not simulated). All four activations; shared experts (Ascend 950's) are computed locally
on every token, unweighted, in fp32 with the routed activation."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .. import mega_moe as pipeline_front
from ..core.call import FFN
from ..core.platforms import resolve_dtype
from ..engine import pipeline
from ..engine.exchange import engine_for
from ..engine.ffn import Activation
from ..errors import MoeDistributeError, invalid, shape
from ..ops.context import context_group, create_context
from ..quant import mx_dequant, mx_fp8

ACTIVATION_PARAMS = {"swiglu": (), "swiglustep": (), "swigluoai": ("alpha", "beta"), "situglu": ("beta", "linear_beta")}
WEIGHT_TYPES = (None, 258, 1, 285, 15, 5, 291, 292, 23, 24)  # int8 (ACL / torch), int4, bf16, fp16, fp8 (ACL / torch)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PIPELINE_NAMES = {
    "num_max_dispatch_tokens_per_rank": "sym_buffer.num_max_tokens_per_rank",
    "w1": "l1_weights",
    "num_experts": "sym_buffer.num_experts",
    "w2": "l2_weights",
    "group world size": "sym_buffer.group",
}


@dataclasses.dataclass
class SymmBuffer:
    """What :func:`get_symm_buffer_for_mega_moe` returns (CANN's attributes): the group, its context (`[4100]`
    `torch.int32`) and CCL bytes, and the call's sizes and modes (``dispatch_quant_mode`` /
    ``dispatch_quant_out_dtype`` may be reassigned between calls, as vllm-ascend does)."""

    group: dist.ProcessGroup
    rank_id: int
    group_name: str
    ep_world_size: int
    context: torch.Tensor
    ccl_buffer_size: int
    num_experts: int
    max_recv_token_num: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    dispatch_quant_mode: int = 0
    dispatch_quant_out_dtype: Any = None
    combine_quant_mode: int = 0
    comm_alg: str = ""
    topo_type: int = 0
    rank_num_per_server: int = 2

    def destroy(self) -> None:
        """Release the buffer (nothing to free here)."""


def get_symm_buffer_for_mega_moe(
    group: dist.ProcessGroup,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    *,
    max_recv_token_num: int = 0,
    dispatch_quant_mode: int = 0,
    dispatch_quant_out_dtype: Any = None,
    combine_quant_mode: int = 0,
    comm_alg: str = "",
) -> SymmBuffer:
    """The buffer ``mega_moe`` runs on (every rank of ``group`` builds one with the same values);
    ``max_recv_token_num`` 0 means ``N * W * min(K, E / W)``; ``intermediate_hidden`` is stored, unused (as CANN)."""
    context, w = create_context(group), dist.get_world_size(group)
    recv = max_recv_token_num or num_max_tokens_per_rank * w * min(num_topk, max(num_experts // w, 1))
    return SymmBuffer(
        group,
        dist.get_rank(group),
        group.group_name,
        w,
        context,
        context_group(context)[1],
        num_experts,
        recv,
        num_max_tokens_per_rank,
        num_topk,
        hidden,
        intermediate_hidden,
        dispatch_quant_mode,
        dispatch_quant_out_dtype,
        combine_quant_mode,
        comm_alg,
    )


def mega_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: list[torch.Tensor],
    l2_weights: list[torch.Tensor],
    sym_buffer: SymmBuffer,
    *,
    l1_weights_sf: Any = None,
    l2_weights_sf: Any = None,
    l1_bias: Any = None,
    l2_bias: Any = None,
    x_active_mask: Any = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    activation_params: dict[str, float] | None = None,
    weight1_type: int | None = None,
    weight2_type: int | None = None,
    shared_l1_weights: Any = None,
    shared_l2_weights: Any = None,
    shared_l1_weights_sf: Any = None,
    shared_l2_weights_sf: Any = None,
    shared_l1_bias: Any = None,
    shared_l2_bias: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dispatch -> GMM1 -> activation -> GMM2 -> combine (collective): ``y[t] = sum_k topk_weights[t, k] *
    FFN_{topk_ids[t, k]}(x[t]) + sum_s FFN_shared_s(x[t])``. ``x`` `[BS, H]` bf16 / fp16; ``topk_ids`` `[BS, K]`
    `torch.int32`; ``topk_weights`` `[BS, K]` fp32 (bf16 accepted); ``l1_weights`` / ``l2_weights``: E/W tensors
    `[H, 2I]` / `[I, H]` (gate columns first; int4: `[H, 2I / 8]` / `[I, H / 8]` int32), or one stacked; int8 / int4
    ones need ``l1_weights_sf`` / ``l2_weights_sf`` (per expert `[2I]` / `[H]` uint64 or int64 Fixpipe words, or
    stacked); ``l1_bias`` / ``l2_bias`` (A8W4's compensation) are not used. ``x_active_mask`` `[BS]` int8 / bool
    prefix (inactive rows: 0).
    ``activation`` / ``activation_clamp`` / ``activation_params``: :class:`~deep_ep_npu.engine.ffn.Activation`.
    ``shared_l1_weights`` `[S, 2I, H]` / ``shared_l2_weights`` `[S, H, I]` (x's dtype). Returns ``y`` `[BS, H]` in
    x's dtype and ``expert_token_nums`` `[E / W]` `torch.int32` (rows each local expert received)."""
    engine, b = engine_for(sym_buffer.group), sym_buffer
    try:
        act = _activation(activation, activation_clamp, activation_params)
        w1, s1 = _weights(l1_weights, l1_weights_sf, weight1_type, "l1_weights", b.dispatch_quant_mode)
        w2, s2 = _weights(l2_weights, l2_weights_sf, weight2_type, "l2_weights", b.dispatch_quant_mode)
        extras = dict(shared_l1_bias=shared_l1_bias, shared_l2_bias=shared_l2_bias)
        extras |= dict(shared_l1_weights_sf=shared_l1_weights_sf, shared_l2_weights_sf=shared_l2_weights_sf)
        if given := [name for name, value in extras.items() if value is not None]:
            raise invalid(given[0], "must be None: shared biases / scales go with 950's fp4 weights (not simulated)")
        if (shared_l1_weights is None) != (shared_l2_weights is None):
            raise invalid("shared_l2_weights", "shared_l1_weights and shared_l2_weights go together")
        mx = (
            resolve_dtype(b.dispatch_quant_out_dtype, "dispatch_quant_out_dtype")
            if b.dispatch_quant_mode == 4
            else None
        )
        if b.dispatch_quant_mode == 4 and mx not in FP8:
            raise invalid("dispatch_quant_out_dtype", f"got {b.dispatch_quant_out_dtype!r}; MX mode 4 takes an fp8")
        act, out_dtype = dataclasses.replace(act, requant=mx), getattr(x, "dtype", None)
        x = mx_dequant(*mx_fp8(x, mx)) if mx is not None and isinstance(x, torch.Tensor) else x  # dispatch's MX
        mask = x_active_mask.bool() if isinstance(x_active_mask, torch.Tensor) else x_active_mask
        weights = topk_weights.float() if isinstance(topk_weights, torch.Tensor) else topk_weights
    except MoeDistributeError as err:
        pipeline_front._agree(engine, err.code, (0,) * len(pipeline_front.NAMES), False)
        raise
    ffn = FFN(w1, w2, s1, s2, out_dtype, act, 1)
    try:
        call, ffn, _ = pipeline_front.prepare(
            engine, x, topk_ids, weights, ffn, b.num_max_tokens_per_rank, b.num_experts, mask
        )
    except MoeDistributeError as err:  # (raised on every rank) in this API's names
        raise err.renamed(PIPELINE_NAMES) from None
    counts = torch.zeros((call.experts.num_local,), dtype=torch.int64, device=x.device)
    y = pipeline.run(engine, call, ffn, counts)
    if shared_l1_weights is not None:
        y = (y.float() + _shared(x, mask, shared_l1_weights, shared_l2_weights, act)).to(y.dtype)
    return y, counts.to(torch.int32)


def _activation(name: object, clamp: object, params: object) -> Activation:
    if name not in ACTIVATION_PARAMS:
        raise invalid("activation", f"got {name!r}; allowed {sorted(ACTIVATION_PARAMS)}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, int | float) or clamp < 0):
        raise invalid("activation_clamp", f"got {clamp!r}; allowed None or a float >= 0 (0: none)")
    extra: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    if unknown := set(extra) - set(ACTIVATION_PARAMS[str(name)]):
        raise invalid("activation_params", f"{sorted(unknown)} not taken by {name!r}: {ACTIVATION_PARAMS[str(name)]}")
    return Activation(str(name), float(clamp or 0.0), **extra)


def _weights(ws: Any, sf: Any, wtype: Any, param: str, quant_mode: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight list as `[E/W, in, out]` (int4 unpacked to int8, fp8 dequantized to fp32) and its fp32 scales
    `[E/W, out]` (int8) or None."""
    if wtype not in WEIGHT_TYPES:
        why = "fp4 (MX) weights are not simulated"
        raise invalid(f"weight{param[1]}_type", f"got {wtype!r}; allowed {WEIGHT_TYPES}; {why}")
    w, name = _stacked(ws, param, 3), param.replace("weights", "weights_sf")
    if wtype == 285 and w.dtype != torch.int32:
        raise invalid(param, f"dtype {w.dtype}: weight type 285 (int4) takes int32 tensors holding 8 int4 each")
    if w.dtype == torch.int32:  # A8W4: 8 int4 per int32, the lowest nibble first
        nibbles = w.contiguous().view(torch.uint8)
        w = torch.stack([nibbles & 15, nibbles >> 4], -1).flatten(-2).to(torch.int8)
        w = torch.where(w > 7, w - 16, w)
    if w.dtype in FP8:  # Ascend 950 A8W8-FP: `[E/W, out, in]`, e8m0 scales `[E/W, out, ceil(in / 64), 2]`
        if quant_mode != 4:
            raise invalid(param, f"{w.dtype} weights need sym_buffer.dispatch_quant_mode 4 (MX, Ascend 950)")
        codes = _stacked(sf, name, 4).view(torch.uint8).flatten(-2)[..., : -(-w.shape[-1] // 32)]
        scale = codes.view(torch.float8_e8m0fnu).float().repeat_interleave(32, -1)[..., : w.shape[-1]]
        return (w.float() * scale).transpose(1, 2), None
    if w.dtype not in (torch.int8, torch.bfloat16, torch.float16):
        raise invalid(param, f"dtype {w.dtype}: simulated are int8, int4 in int32, fp8, bf16 / fp16")
    if (w.dtype == torch.int8) != (quant_mode == 2):
        why = "int8 weights need dispatch_quant_mode 2, bf16 / fp16 ones 0 (Atlas A2 / A3)"
        raise invalid(param, f"{w.dtype} with sym_buffer.dispatch_quant_mode {quant_mode}: {why}")
    if w.dtype != torch.int8:
        return w, None
    words = _stacked(sf, name, 2)
    if words.shape != (w.shape[0], w.shape[2]):
        raise shape(name, f"shape {tuple(words.shape)} must be (E/W, {w.shape[2]}) (one word per output channel)")
    low = words.contiguous().view(torch.int64).view(torch.int32)[..., 0::2]  # little-endian: the low word first
    return w, low.contiguous().view(torch.float32)


def _stacked(ts: Any, param: str, dims: int) -> torch.Tensor:
    """A list of per-expert tensors, or of one stacked (``dims`` dims), as one stacked tensor."""
    if not isinstance(ts, list | tuple) or not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        raise invalid(param, "must be a non-empty list of tensors (one per local expert, or one stacked)")
    return ts[0] if len(ts) == 1 and ts[0].dim() == dims else torch.stack(list(ts))


def _shared(x: torch.Tensor, mask: Any, w1: torch.Tensor, w2: torch.Tensor, act: Activation) -> torch.Tensor:
    """Shared experts on every active token, fp32: ``sum_s act(x @ w1[s]^T) @ w2[s]^T``."""
    out = sum(act(x.float() @ a.float().T) @ b.float().T for a, b in zip(w1, w2, strict=True))
    return out * (1.0 if mask is None else mask.unsqueeze(1).float())
