"""DeepEP-Ascend's low-latency API (sgl-kernel-npu's ``deep_ep``, https://github.com/sgl-project/sgl-kernel-npu,
``python/deep_ep/deep_ep/buffer.py``) on :class:`deep_ep_npu.Buffer`: what an engine written for NPUs' ``deep_ep``
reads back from ``low_latency_dispatch`` differs from DeepEP's, in layout and in quantization.

DeepEP (and :meth:`deep_ep_npu.Buffer.low_latency_dispatch`): ``[L, R * N, hidden]`` rows padded per local expert,
``recv_count`` `[L]` `torch.int32`, ``use_fp8`` DeepEP's block-128 e4m3 with `[L, R * N, hidden / 128]` fp32 scales
(per-token int8 on the ascend backend). DeepEP-Ascend: the flat layout of ``npu_moe_distribute_dispatch_v2`` —
``[R * N * min(K, L), hidden]`` rows, local expert 0's first with no gaps, ``recv_count`` `[L]` `torch.int64` counts
(what ``npu_grouped_matmul`` takes as ``group_list``, type 1), and ``use_fp8`` (when ``quant_mode`` is None) per-token
dynamic int8 with one fp32 scale per row `[R * N * min(K, L)]`, on every platform. SGLang's Ascend MoE runner reads
that layout (``pre_permute_deepep_ll_to_ascend``: hidden states as grouped rows, ``masked_m`` as the group list, the
scales as ``pertoken_scale``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .buffer import Buffer
from .errors import invalid
from .handle import EventOverlap, FlatHandle

QUANT_MODES = {None: 0, "int8": 2}  # DeepEP-Ascend's quant_mode -> the Ascend op's; its A5 modes are not here
UNSUPPORTED = ("mx_fp8_e4m3", "mx_fp8_e5m2", "pertoken_fp8_e4m3", "mx_fp4_e2m1")


def resolve_quant_mode(use_fp8: bool, use_ue8m0: bool, use_mxfp4: bool, quant_mode: str | None) -> int:
    """DeepEP-Ascend's choice: ``quant_mode`` when given, else ``use_mxfp4`` -> "mx_fp4_e2m1", ``use_fp8`` and
    ``use_ue8m0`` -> "mx_fp8_e4m3", ``use_fp8`` -> "int8", else None; as the Ascend op's quant_mode (0 or 2)."""
    if quant_mode is None:
        if use_mxfp4:
            quant_mode = "mx_fp4_e2m1"
        elif use_fp8 and use_ue8m0:
            quant_mode = "mx_fp8_e4m3"
        elif use_fp8:
            quant_mode = "int8"
    if quant_mode not in QUANT_MODES:
        known = "an Ascend 950 mode, not implemented here" if quant_mode in UNSUPPORTED else "not DeepEP-Ascend's"
        allowed = "None or 'int8' (use_fp8=True), without use_ue8m0 / use_mxfp4"
        raise invalid("quant_mode", f"resolves to {quant_mode!r} ({known}); allowed {allowed}")
    return QUANT_MODES[quant_mode]


class DeepEPAscendBuffer(Buffer):
    """:class:`deep_ep_npu.Buffer` with DeepEP-Ascend's ``low_latency_dispatch`` / ``low_latency_combine`` (module
    docstring); everything else is the Buffer's. ``import deep_ep`` gives this class as ``deep_ep.Buffer`` where
    ``DEEP_EP_NPU_ALIAS_API=deep_ep_ascend`` (:mod:`deep_ep_npu.alias`)."""

    def low_latency_dispatch(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        use_mxfp4: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        topk_weights: torch.Tensor | None = None,
        quant_mode: str | None = None,
    ) -> tuple[
        torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, FlatHandle, EventOverlap, Callable | None
    ]:
        """DeepEP-Ascend's low-latency dispatch. N = num_max_dispatch_tokens_per_rank, R ranks, K top-k, L local
        experts, A = R * N * min(K, L).

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` (`torch.float32` too on the reference backend), T <= N.
            topk_idx: `[T, K]` `torch.int64` / `torch.int32`, ids in ``[0, num_experts)`` or -1 (no expert).
            num_max_dispatch_tokens_per_rank, num_experts: N and the routed experts, equal on every rank.
            cumulative_local_expert_recv_stats, round_scale: accepted and unused, as DeepEP-Ascend does.
            use_fp8, use_ue8m0, use_mxfp4, quant_mode: the quantization (:func:`resolve_quant_mode`): bf16 or
                per-token dynamic int8 (``q = rint(x * 127 / amax)``, scale ``amax / 127``).
            topk_weights: `[T, K]` `torch.float32` or None (the op's ``expert_scales``).
            async_finish, return_recv_hook: as DeepEP's (receive on the event's wait / on the hook).

        Returns:
            recv_x: `[A, hidden]` in x's dtype, or with int8 ``(data [A, hidden] torch.int8, scales [A]
                torch.float32)``; rows grouped by local expert (expert 0's first), then source rank and token; rows
                past ``recv_count.sum()`` are zero.
            recv_count: `[L]` `torch.int64` rows per local expert. handle: for ``low_latency_combine``.
            event: :class:`EventOverlap`. hook: the receive with ``return_recv_hook``, else None.
        Filled once the receive ran."""
        with self._backend.rejecting("low_latency_dispatch"):
            mode = resolve_quant_mode(use_fp8, use_ue8m0, use_mxfp4, quant_mode)
        out, event, hook = self.low_latency_dispatch_flat(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            topk_weights=topk_weights,
            quant_mode=mode,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
        )
        data, scales, counts, handle = out.pending  # filled in place by the receive
        return ((data, scales) if mode else data), counts, handle, event, hook

    def low_latency_combine(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: FlatHandle,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable | None]:
        """DeepEP-Ascend's low-latency combine: ``x`` `[A, hidden]` `torch.bfloat16` expert outputs row-aligned with
        the dispatch's ``recv_x``; ``topk_idx`` `[T, K]` and ``topk_weights`` `[T, K]` `torch.float32` as dispatched;
        ``handle`` the dispatch's; ``zero_copy`` accepted (nothing is staged); ``out`` `[T, hidden]` or None.
        Returns ``(combined_x [T, hidden] in x's dtype: sum_k topk_weights[t, k] * x[row of (t, k)], event,
        hook)``."""
        return self.low_latency_combine_flat(
            x, topk_idx, topk_weights, handle, out=out, async_finish=async_finish, return_recv_hook=return_recv_hook
        )
