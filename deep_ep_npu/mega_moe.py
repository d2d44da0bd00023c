"""``mega_moe(group, ...)``: dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one call, as the A5 PTO MegaMoE kernel
(``Buffer.mega_moe`` runs it on a Buffer's backend). The expert math: :mod:`deep_ep_npu.engine.ffn`; the pipelined
schedule: :mod:`deep_ep_npu.engine.pipeline`; the fused NPU op: :mod:`deep_ep_npu.backends.ascend`."""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from .backends import Backend, create_backend
from .core import fused, rules
from .core.call import FFN, FusedCall
from .engine.exchange import check_names, check_status, engine_for, header
from .engine.rows import DTYPE_CODES
from .errors import MoeDistributeError
from .transports.agreement import STATUS_OK
from .transports.names import resolve_group

OP = "mega_moe"
MAX_WORLD_SIZE = 16  # the A5 PTO MegaMoE kernel: worldSize in [1, 16]
MAX_TOKENS_PER_RANK = 512  # the dispatch op's Bs limit
NAMES = ("num_experts", "hidden", "N", "topk", "weight dtype", "out_dtype", "num_max_dispatch_tokens_per_rank",
         "num_segments", "segment_by", "swiglu_limit")  # fmt: skip


def mega_moe(
    group: dist.ProcessGroup | str,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    out_dtype: torch.dtype | None = None,
    max_output_size: int | None = None,
    num_segments: int | None = None,
    segment_by: str = "expert",
    x_active_mask: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    backend: str = "reference",
) -> torch.Tensor:
    """Fused expert-parallel MoE layer: ``out[t] = sum_k topk_weights[t, k] * FFN_{topk_idx[t, k]}(x[t])``.

    Every rank of ``group`` calls this together (a rank with no tokens passes ``M = 0``); rank r hosts the experts
    ``[r * E_local, (r + 1) * E_local)``, ``E_local = num_experts / W``. FFN = GMM1 -> SwiGLU ``silu(gate) * up`` ->
    GMM2: int8 weights on per-token int8 activations, or float weights in fp32 (exact spec:
    :mod:`deep_ep_npu.engine.ffn`), pipelined per segment so that one segment's communication overlaps another's
    compute (:mod:`deep_ep_npu.engine.pipeline`).

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
        segment_by: ``"expert"`` (the kernel's: a segment is a group of local experts; partial sums travel in fp32,
            equal to the unfused path up to fp32 re-association, bit-equal with one segment) or ``"token"`` (a chunk
            of each rank's tokens, all experts; rows travel in ``out_dtype``, bit-equal to the unfused path).
        x_active_mask: `[M]` `torch.bool`, True for a prefix of the tokens (vllm-ascend's ``mc2_mask``), or None (all
            active). Tokens after the prefix are not dispatched, their topk_idx / topk_weights rows are not checked
            (padding garbage is fine) and their output rows are 0.
        swiglu_limit: the fused op's SwiGLU clamp, ``gate = min(gate, L)``, ``up = clamp(up, -L, L)`` before
            ``silu(gate) * up``, for L > 0; None or 0.0: no clamp (bit-identical to not passing it). Same on all ranks.
        backend: ``reference`` (any torch.distributed backend), ``ascend`` (the fused NPU op
            ``torch.ops._C_ascend.dispatch_ffn_combine`` when present and the call fits it, else reference; with
            :mod:`deep_ep_npu.sim` installed, the stand-in op) or ``auto``.

    Returns `[M, K]` with ``out_dtype``: expert outputs rounded to it, weighted and summed in fp32, rounded again.

    Raises:
        MoeDistributeError: (a ``ValueError`` naming the parameter) on every rank, before any token moves, when any
            rank's input is invalid or the ranks disagree on a value that must be the same on all (:data:`NAMES`).
        ValueError: unknown ``backend``. ImportError: ``ascend`` without torch_npu.
    """
    pg = resolve_group(group, "group")
    impl = engine_for(pg) if backend == "reference" else create_backend(backend, pg)
    ffn = FFN(w1, w2, w1_scale, w2_scale, out_dtype, swiglu_limit, num_segments, segment_by, max_output_size)
    return run(impl, x, topk_idx, topk_weights, ffn, num_max_dispatch_tokens_per_rank, num_experts, x_active_mask)


def run(
    backend: Backend,
    x: object,
    topk_idx: object,
    topk_weights: object,
    ffn: FFN,
    num_max: object,
    num_experts: object,
    x_active_mask: object,
) -> torch.Tensor:
    """:func:`mega_moe` on ``backend``'s group: :func:`prepare`, then the backend runs it."""
    return backend.mega_moe(*prepare(backend, x, topk_idx, topk_weights, ffn, num_max, num_experts, x_active_mask))


def prepare(
    backend: Backend,
    x: object,
    topk_idx: object,
    topk_weights: object,
    ffn: FFN,
    num_max: object,
    num_experts: object,
    x_active_mask: object,
) -> tuple[FusedCall, FFN, bool]:
    """Validate (on every rank) and agree (every rank raises if any rank's input is invalid or the ranks disagree);
    returns the call, its FFN and whether every rank can run it as the fused op."""
    ep = backend.ep
    try:
        rules.in_range(ep.num_ranks, "group world size", 1, MAX_WORLD_SIZE)
        n = rules.in_range(num_max, "num_max_dispatch_tokens_per_rank", 1, MAX_TOKENS_PER_RANK)
        rules.in_range(num_experts, "num_experts", 1, 1 << 16)
        experts = rules.plain_experts(ep.num_ranks, ep.rank, num_experts, "num_experts")
        x_, ids, weights, mask = fused.tokens(x, topk_idx, topk_weights, x_active_mask, n, experts)
        ffn = fused.ffn(ffn, x_, experts.num_local, ids.shape[1], n, ep.num_ranks)
    except MoeDistributeError as err:
        if not backend.agreed:  # (once a fingerprint is agreed, checks are local: the peers wait in the op)
            _agree(backend, err.code, (0,) * len(NAMES), False)
        raise
    call = FusedCall(OP, x_, ids, experts, num_max=n, x_active_mask=mask, expert_scales=weights)
    assert ffn.out_dtype is not None and ffn.num_segments is not None, "checked by fused.ffn"
    sizes = (experts.num_moe_experts, x_.shape[1], ffn.w2.shape[1], ids.shape[1])  # (E, K, N, topK)
    dtypes = (DTYPE_CODES[ffn.w1.dtype], DTYPE_CODES[ffn.out_dtype])
    limit = ffn.swiglu_limit  # a float, or CANN's Activation: agreed by the crc of its repr
    limit_bits = (
        zlib.crc32(repr(limit).encode()) >> 1 if callable(limit) else struct.unpack("<i", struct.pack("<f", limit))[0]
    )
    fingerprint = (*sizes, *dtypes, n, ffn.num_segments, ("expert", "token").index(ffn.segment_by), limit_bits)
    can_fuse = backend.can_fuse(call, ffn)
    if backend.agreed is not None and can_fuse and fingerprint in backend.agreed:
        return call, ffn, True  # (every rank agreed to fuse this kind of call before: no round)
    every_rank_fuses = _agree(backend, STATUS_OK, fingerprint, can_fuse)
    if backend.agreed is not None and every_rank_fuses:
        backend.agreed.add(fingerprint)
    return call, ffn, every_rank_fuses


def _agree(backend: Backend, status: int, fingerprint: tuple[int, ...], can_fuse: bool) -> bool:
    """The agreement step of a call (status, fingerprint, whether this rank can fuse); returns whether every rank
    can fuse, or raises the same error on every rank."""
    ep = backend.ep
    words = header(0, (), (int(can_fuse), *fingerprint), ep.num_ranks)
    agreement = ep.start_agree(OP, status, [[0, -1]] * ep.num_ranks, words, device=ep.device)()
    if status != STATUS_OK:
        return False
    check_status(agreement)
    check_names(agreement, ep, NAMES, 2 + 2 * ep.num_ranks)
    return all(fp[1 + 2 * ep.num_ranks] for fp in agreement.shared)
