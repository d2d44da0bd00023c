"""``deep_ep_npu.Buffer``: DeepEP's low-latency ``Buffer`` API on Ascend NPUs or any torch.distributed group.

Code written for ``deep_ep.Buffer`` in low-latency mode runs unchanged with ``from deep_ep_npu import Buffer``:
same constructor, ``low_latency_dispatch`` / ``low_latency_combine`` signatures, defaults, return tuples and
layouts. The work is done by a backend picked by name (``backend="reference"`` / ``"ascend"`` / ``"auto"``).

Overlap, two ways (both as in DeepEP):

- ``return_recv_hook=True``: the call runs only the send phase and returns ``hook``; ``hook()`` runs the
  receive. Compute placed between them overlaps the communication::

      recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, N, E, return_recv_hook=True)
      y_other = attention_of_the_other_micro_batch()    # overlaps the dispatch
      hook()                                            # recv_x / recv_count / handle are valid from here on

- ``async_finish=True``: the returned :class:`EventOverlap` completes the receive on ``current_stream_wait()``
  (or at the end of a ``with event:`` block).

Buffer reuse (DeepEP's rule: do not hold more than 2 low-latency results at a time): the backend's communication
buffers are double-buffered and flip on every dispatch and combine, and dispatch results (``recv_x``, its scales,
``recv_count``, the handle's tensors) alternate between two sets, so they stay valid until the next-but-one
dispatch. Finish a call's receive (``hook()`` / the event) before the next-but-one low-latency call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import profiling
from .backends import BufferConfig, create_backend, resolve_backend_name
from .backends import spec as ll_spec
from .buffer_compat import CompatMixin, hint_bytes
from .buffer_flat import FlatMixin
from .buffer_shrink import ShrinkMixin
from .event import Completion, EventOverlap
from .failure import EPRankFailure, resolve_timeout
from .handle import LowLatencyHandle
from .ops import MoeDistributeError
from .ops.errors import invalid


class Buffer(CompatMixin, FlatMixin, ShrinkMixin):
    """The low-latency expert-parallel communication buffer (DeepEP-compatible).

    Arguments:
        group: the EP ``ProcessGroup`` (required).
        num_nvl_bytes: accepted for compatibility; unused (there is no NVLink buffer).
        num_rdma_bytes: bytes of the low-latency buffer; 0 lets the backend size it on demand. When > 0, a call
            whose ``get_low_latency_rdma_size_hint`` exceeds it raises, naming the size needed.
        low_latency_mode: accepted; this Buffer implements the low-latency mode only (normal-mode kernels are absent).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted for compatibility; unused.
        explicitly_destroy: the caller must call :meth:`destroy`; without it, resources are released with the object.
        enable_shrink: enables the mask buffer (``low_latency_update/query/clean_mask_buffer``); on the reference
            backend a rank that exits or stops calling is then masked by the survivors, who continue (``timeout``).
        backend: ``"auto"`` (``"ascend"`` when torch_npu and an NPU are present, else ``"reference"``),
            ``"reference"`` (torch.distributed) or ``"ascend"`` (ops-transformer V3 context ops or torch_npu).
        ccl_buffer_size: MB of HCCL window the Ascend ops may use (``get_low_latency_ccl_buffer_size``). When given,
            shapes that need more raise, naming the size needed (ascend backend, and the flat methods on both
            backends). None: the ascend backend checks ``HCCL_BUFFSIZE`` if set (torch_npu ops) or sizes the V3
            context from the first call's shapes.
        timeout: seconds each collective wait of this Buffer may take (keyword-only extension). A rank that exits
            or stops calling makes every other rank raise :class:`deep_ep_npu.EPRankFailure` naming it within about
            this time (never a hang). None: ``DEEP_EP_NPU_TIMEOUT``, else 30 s (DeepEP's kernels: ~100 s). With
            ``enable_shrink``, the survivors instead agree on the failed ranks, continue on a group of themselves,
            mask the failed ranks and re-run the interrupted call (reference backend; see "Failure handling").
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        *,
        backend: str = "auto",
        ccl_buffer_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        if group is None:
            raise ValueError("group: a torch.distributed ProcessGroup is required (deep_ep_npu has no mpi4py comm)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if ccl_buffer_size is not None and (not isinstance(ccl_buffer_size, int) or ccl_buffer_size < 1):
            raise ValueError(f"ccl_buffer_size: must be None or a positive int (MB), got {ccl_buffer_size!r}")
        timeout = resolve_timeout(timeout)
        self.backend_name = resolve_backend_name(backend)
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.config = BufferConfig(
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode,
            num_qps_per_rank,
            allow_nvlink_for_low_latency_mode,
            allow_mnnvl,
            explicitly_destroy,
            enable_shrink,
            ccl_buffer_size,
            timeout,
        )
        self._backend = create_backend(self.backend_name, group, self.config)
        self._destroyed = False

    # ---- helpers --------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; create a new one")

    def _validated(self, op: str, validate: Callable[[], Any]) -> Any:
        """Run local validation; on failure tell the peers (so they raise too) and raise."""
        try:
            return validate()
        except MoeDistributeError as err:
            self._backend.abort(op, err.code)
            raise

    def _check_rdma_size(self, num_max: int, hidden: int, num_experts: int) -> None:
        need = hint_bytes(num_max, hidden, num_experts)
        if self.num_rdma_bytes and need > self.num_rdma_bytes:
            raise invalid(
                "num_rdma_bytes",
                f"{self.num_rdma_bytes} bytes is too small for N={num_max}, hidden={hidden}, num_experts={num_experts}:"
                f" {need} bytes needed (Buffer.get_low_latency_rdma_size_hint)",
            )

    @staticmethod
    def _overlap(completion: Completion, async_finish: bool, return_recv_hook: bool, tensors: tuple):
        if return_recv_hook:
            return EventOverlap(None), completion
        if async_finish:
            return EventOverlap(completion, tensors), None
        completion.wait()
        return EventOverlap(None), None

    # ---- low-latency dispatch / combine -----------------------------------------------------------------------
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        *,
        quant_format: str | None = None,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Send each token to the ranks hosting its experts (DeepEP low-latency dispatch). Every rank must call it,
        also with 0 tokens. N = num_max_dispatch_tokens_per_rank, L = num_experts / R local experts, R ranks.

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16` (`torch.float16` / `torch.float32` also accepted),
                ``num_tokens <= N``; with ``use_fp8``, ``hidden % 128 == 0``.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64` or `torch.int32`, ``num_topk <= 16``; ids in
                ``[0, num_experts)`` or ``-1`` (no expert); an expert at most once per token.
            num_max_dispatch_tokens_per_rank: N, the same on every rank.
            num_experts: total experts, the same on every rank, divisible by R.
            cumulative_local_expert_recv_stats: `[L]` `torch.int32` or None; ``recv_count`` is added to it.
            dispatch_wait_recv_cost_stats: `[R]` `torch.int64` or None; the nanoseconds this rank waited for the
                receive are added to every entry (a collective completes for all sources at once).
            use_fp8: quantize to the backend's 8-bit format (``quant_format``), else keep x's dtype.
            round_scale: round fp8 scales up to powers of two. use_ue8m0: store them as packed UE8M0 (needs
                round_scale and ``hidden % 512 == 0``).
            async_finish: return an event whose wait completes the receive. return_recv_hook: return ``hook``
                (call it to receive); not both.
            quant_format (keyword-only extension): the 8-bit format of ``use_fp8``: ``"fp8_e4m3"`` (DeepEP's
                per-128-channel e4m3, the reference default) or ``"int8_per_token"`` (Ascend A2/A3's per-token
                dynamic int8, ``q = rint(x * 127 / amax)``, scale ``amax / 127``; the Ascend default). None: the
                backend's default.

        Returns:
            recv_x: `[L, R * N, hidden]` in x's dtype, or with ``use_fp8`` a tuple ``(data, scales)``: data
                `[L, R * N, hidden]` `torch.float8_e4m3fn` (`torch.int8` for int8_per_token) and scales
                `[L, R * N, hidden // 128]` `torch.float32` (token dim stride 1, as DeepEP; int8: the row's single
                scale repeated per group, so ``data * scales`` per 128 channels dequantizes both formats), or with
                ``use_ue8m0`` `[L, R * N, hidden // 512]` `torch.int32`. Rows past ``recv_count`` are undefined.
            recv_count: `[L]` `torch.int32` rows received per local expert.
            handle: :class:`LowLatencyHandle` (``handle[0]`` src_info `[L, R * N]` int32, ``handle[1]`` layout_range
                `[L, R]` int64 ``(begin << 32) | count``), for ``low_latency_combine``.
            event: :class:`EventOverlap` (meaningful with ``async_finish``).
            hook: the receive phase with ``return_recv_hook``, else None.

        Raises:
            MoeDistributeError (a ValueError): invalid input on any rank, or N / num_experts / hidden / format
            differing across ranks; raised on every rank, before any payload moves.
            EPRankFailure (a RuntimeError): a peer exited or stopped calling (without ``enable_shrink``), raised
            here or by ``hook()`` / the event on every surviving rank, naming the missing ranks.
        """
        self._check_alive()
        backend = self._backend

        def validate() -> ll_spec.DispatchArgs:
            args = ll_spec.validate_dispatch(
                self.group_size,
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats,
                use_fp8,
                round_scale,
                use_ue8m0,
                async_finish,
                return_recv_hook,
                quant_format,
                backend.native_quant_format,
            )
            self._check_rdma_size(args.num_max_dispatch_tokens_per_rank, args.hidden, args.num_experts)
            backend.check_device(args.x, "x")
            return args

        lap = profiling.laps("dispatch")
        args = self._validated("dispatch", validate)
        lap("validation")
        res = backend.dispatch(args)
        tensors = (res.recv_x, res.recv_count, res.handle)
        event, hook = self._overlap(res.completion, async_finish, return_recv_hook, tensors)
        return res.recv_x, res.recv_count, res.handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle | tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Return expert outputs to their source ranks and reduce them there (DeepEP low-latency combine).

        Arguments:
            x: `[L, R * N, hidden]` with `torch.bfloat16` (`torch.float16` / `torch.float32` accepted): expert
                outputs, row-aligned with dispatch's ``recv_x``. Ignored with ``zero_copy``.
            topk_idx: `[num_tokens, num_topk]` `torch.int64` / `torch.int32`, the one given to dispatch.
            topk_weights: `[num_tokens, num_topk]` `torch.float32`.
            handle: the dispatch's handle.
            use_logfmt: not implemented (raises if True).
            zero_copy: combine the bfloat16 buffer from ``get_next_low_latency_combine_buffer(handle)`` (filled by
                the caller) instead of ``x``.
            async_finish, return_recv_hook: as in dispatch.
            out: `[num_tokens, hidden]` in x's dtype, written in place and returned, or None.
            combine_wait_recv_cost_stats: `[R]` `torch.int64`; the receive wait (ns) is added to every entry.

        Returns:
            combined_x: `[num_tokens, hidden]` in x's dtype: ``sum_k topk_weights[t, k] * expert_out[t, k]`` over
                ``topk_idx[t, k] >= 0`` (and experts of unmasked ranks), accumulated in fp32; all -1 ids give 0.
            event: :class:`EventOverlap`. hook: the receive phase with ``return_recv_hook``, else None.

        Raises:
            MoeDistributeError: invalid input on any rank, or a handle / topk_idx that does not match the dispatch.
            EPRankFailure: a peer exited or stopped calling (as in dispatch).
        """
        self._check_alive()

        def validate() -> ll_spec.CombineArgs:
            self._backend.check_device(x, "x")
            return ll_spec.validate_combine(
                self.group_size,
                x,
                topk_idx,
                topk_weights,
                handle,
                use_logfmt,
                zero_copy,
                async_finish,
                return_recv_hook,
                out,
                combine_wait_recv_cost_stats,
            )

        lap = profiling.laps("combine")
        args = self._validated("combine", validate)
        lap("validation")
        res = self._backend.combine(args)
        event, hook = self._overlap(res.completion, async_finish, return_recv_hook, (res.combined_x,))
        return res.combined_x, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle | tuple) -> torch.Tensor:
        """The `[L, R * N, hidden]` `torch.bfloat16` buffer the next ``zero_copy`` combine reads: write the expert
        outputs into it, then call ``low_latency_combine(..., zero_copy=True)`` with no other low-latency call in
        between (the buffers flip on every call)."""
        self._check_alive()
        return self._backend.next_combine_buffer(ll_spec.validate_handle(handle, self.group_size))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffer state between two barriers (collective: every rank must call it; the
        barriers are bounded by ``timeout`` like dispatch and combine)."""
        self._check_alive()
        self._backend.ep.barrier("clean_low_latency_buffer")
        self._backend.clean()
        self._backend.ep.barrier("clean_low_latency_buffer")

    # ---- fused MegaMoE (deep_ep_npu/mega_moe) --------------------------------------------------------------------
    def mega_moe(
        self,
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
        **kwargs: Any,
    ) -> torch.Tensor:
        """dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one call, pipelined per local expert, on this Buffer's
        group and backend (delegates to :func:`deep_ep_npu.mega_moe.mega_moe`, which documents the math and the
        extra keywords ``max_output_size`` / ``num_segments``).

        Arguments:
            x: `[M, K]` with `torch.bfloat16` (`torch.float16` / `torch.float32` on the reference backend).
            topk_idx: `[M, topK]` with `torch.int32` / `torch.int64` (-1: no expert).
            topk_weights: `[M, topK]` with `torch.float32`.
            w1: `[E_local, K, 2N]` (gate then up) with `torch.int8` when scales are given, else a float dtype.
            w2: `[E_local, N, K]`, w1's dtype.
            w1_scale: `[E_local, 2N]` / w2_scale: `[E_local, K]` with `torch.float32` per-channel scales, or None.

        Returns:
            out: `[M, K]` with ``out_dtype`` (default x's dtype): ``sum_k topk_weights[t, k] * FFN_e(x[t])``.
        """
        from .mega_moe import mega_moe

        self._check_alive()
        return mega_moe(
            self.group, x, topk_idx, topk_weights, w1, w2, w1_scale=w1_scale, w2_scale=w2_scale,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
            out_dtype=out_dtype, backend=self.backend_name, **kwargs,
        )  # fmt: skip

    # ---- lifetime -------------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffers and communication context. Requires ``explicitly_destroy=True`` (as DeepEP);
        calling it again is a no-op; using the Buffer afterwards raises.

        Collective: every live rank calls it. It first waits (bounded) until every peer got here, so no rank tears
        its process group down while a peer still finishes the last combine (gloo aborts a process whose peer closes
        the connection mid-collective). A peer that is already gone is not waited for."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs explicitly_destroy=True at construction (else it runs on deletion)")
        if not self._destroyed:
            self._destroyed = True
            with contextlib.suppress(EPRankFailure):  # a peer that is gone leaves nothing to wait for
                self._backend.ep.barrier("destroy")
            self._backend.destroy()

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True) and not getattr(self, "_destroyed", True):
            self._destroyed = True
            self._backend.destroy()
