"""``mega_moe(group, ...)``: dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one call, as the A5 PTO MegaMoE kernel."""

import dataclasses
from typing import Any

import torch

from ..errors import MoeDistributeError
from ..group import EPGroup, ep_group
from ..group_names import resolve_group
from .ascend import MegaMoeBackend, create_backend
from .params import AGREE_WIDTH, MAX_WORLD_SIZE, MegaMoeArgs, agree, validate


def mega_moe(
    group, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
    w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None, num_max_dispatch_tokens_per_rank: int,
    num_experts: int, out_dtype: torch.dtype | None = None, max_output_size: int | None = None,
    num_segments: int | None = None, segment_by: str = "expert", x_active_mask: torch.Tensor | None = None,
    swiglu_limit: float | None = None, backend: str = "reference",
) -> torch.Tensor:  # fmt: skip
    """Fused expert-parallel MoE layer: ``out[t] = sum_k topk_weights[t, k] * FFN_{topk_idx[t, k]}(x[t])``.

    Every rank of ``group`` calls this together (a rank with no tokens passes ``M = 0``); rank r hosts the experts
    ``[r * E_local, (r + 1) * E_local)``, ``E_local = num_experts / W``. FFN = GMM1 -> SwiGLU ``silu(gate) * up`` ->
    GMM2, int8 weights on per-token dynamic int8 activations (re-quantized after SwiGLU) with exact int32 accumulation,
    per-channel weight scales and the fused kernel's fp16 GMM outputs, float weights in fp32 with GMM1 / SwiGLU outputs
    rounded to the weights' dtype (exact spec: :mod:`.ffn`), pipelined per segment so that one segment's communication
    overlaps another's compute (:mod:`.pipeline`).

    Arguments:
        group: the EP ``ProcessGroup`` (or its name), W ranks with W in [1, 16].
        x: `[M, K]` `torch.bfloat16` or `torch.float16` (also `torch.float32` on the reference path), M <=
            num_max_dispatch_tokens_per_rank.
        topk_idx: `[M, topK]` `torch.int32` / `torch.int64`, topK in [1, 16]; ids distinct per row, in
            ``[0, num_experts)`` or -1 (no expert). topk_weights: `[M, topK]` `torch.float32` router probabilities.
        w1: `[E_local, K, 2N]` (last dim: gate, the first N, then up), w2: `[E_local, N, K]`; both `torch.int8` when
            scales are given, else both `torch.bfloat16`, `torch.float16` or `torch.float32`.
        w1_scale / w2_scale: `[E_local, 2N]` / `[E_local, K]` `torch.float32` per-output-channel scales, or None.
        num_max_dispatch_tokens_per_rank: the largest M of any rank (same on all ranks), in [1, 512].
        num_experts: routed experts in total, divisible by W.
        out_dtype: `torch.float16` (the A5 PTO MegaMoE kernel's), `torch.bfloat16` or `torch.float32`; None: x's
            (the fused op is used only when it is x's dtype).
        max_output_size: the fused op's per-rank routed-row workspace, >= M * topK (default
            ``num_max_dispatch_tokens_per_rank * topK * W``); validated only on the reference path.
        num_segments: pipeline segments, in [1, E_local] (by expert) or [1, num_max_dispatch_tokens_per_rank] (by
            token); default min(that bound, 2); 1 = no overlap.
        segment_by: ``"expert"`` (the kernel's: segment k = a contiguous group of local experts; partial sums travel
            in fp32, equal to the unfused path up to fp32 re-association; with one segment rows travel in
            ``out_dtype``, bit-equal) or ``"token"`` (a chunk of each rank's tokens, all experts; rows travel in
            ``out_dtype``, bit-equal to the unfused path, half the bytes).
        x_active_mask: `[M]` `torch.bool`, True for a prefix of the tokens (vllm-ascend's ``mc2_mask``), or None (all
            active). Tokens after the prefix are not dispatched, their topk_idx / topk_weights rows are not checked
            (padding garbage is fine) and their output rows are 0.
        swiglu_limit: the fused op's SwiGLU clamp, ``gate = min(gate, L)``, ``up = clamp(up, -L, L)`` before
            ``silu(gate) * up``, for L > 0; None or 0.0: no clamp (bit-identical to not passing it). Same on all ranks.
        backend: ``reference`` (any torch.distributed backend), ``ascend`` (the fused NPU op
            ``torch.ops._C_ascend.dispatch_ffn_combine`` when present and the call fits it, see
            :mod:`.ascend`, else reference; with :mod:`deep_ep_npu.sim` installed, the stand-in op) or ``auto``.

    Returns `[M, K]` with ``out_dtype``: expert outputs rounded to it, weighted and summed in fp32, rounded again.

    Raises:
        MoeDistributeError: (a ``ValueError``) invalid input, naming the parameter, the value and what is allowed;
            raised on every rank (before any token moves) when any rank's input is invalid or ranks disagree on
            num_experts, K, N, topK, the weight dtype, out_dtype, num_max_dispatch_tokens_per_rank, the segments or
            swiglu_limit.
        ValueError: unknown ``backend``. ImportError: ``ascend`` without torch_npu.
    """
    return run_mega_moe(
        ep_group(resolve_group(group, "group")), backend, x, topk_idx, topk_weights, w1, w2, w1_scale=w1_scale,
        w2_scale=w2_scale, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
        out_dtype=out_dtype, max_output_size=max_output_size, num_segments=num_segments, segment_by=segment_by,
        x_active_mask=x_active_mask, swiglu_limit=swiglu_limit,
    )  # fmt: skip


def run_mega_moe(ep: EPGroup, backend: str, *args: Any, transport: Any = None, **kwargs: Any) -> torch.Tensor:
    """:func:`mega_moe` on ``ep`` (a Buffer's group: its timeout and shrink state) and ``transport`` (the Buffer's
    engine transport, which the reference pipeline's dispatches and combines take; None: the collective path)."""
    impl = create_backend(backend)
    valid, fused = agreed_args(ep, impl, *args, **kwargs)
    return impl.run(dataclasses.replace(valid, transport=transport), fused)


def agreed_args(ep: EPGroup, impl: MegaMoeBackend, *args: Any, **kwargs: Any) -> tuple[MegaMoeArgs, bool]:
    """Validate one rank's :func:`validate` arguments and run the agreement step (every rank raises if any rank's
    input is invalid or the ranks disagree); returns the validated call and whether every rank can fuse it."""
    device = args[0].device if args and isinstance(args[0], torch.Tensor) else None
    try:
        valid = validate(ep.group, *args, ep=ep, **kwargs)
    except MoeDistributeError as err:
        if 1 <= ep.num_ranks <= MAX_WORLD_SIZE:
            ep.reject("mega_moe", err.code, 0, AGREE_WIDTH)
        raise
    return valid, agree(ep, valid.fingerprint(), impl.can_fuse(valid), device)
