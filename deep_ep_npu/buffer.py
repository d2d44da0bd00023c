"""``deep_ep_npu.Buffer``: DeepEP's low-latency ``Buffer`` on Ascend NPUs or any torch.distributed group (code written
for ``deep_ep.Buffer`` in low-latency mode runs unchanged), with the rest of DeepEP's legacy ``Buffer`` (its normal
mode: :mod:`.buffer_normal`) and the Ascend extras of :mod:`.buffer_ascend`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .backends import create_backend, resolve_backend_name
from .buffer_ascend import AscendMethods
from .buffer_compat import CompatMethods, ascend_quant
from .buffer_layout import host_nodes
from .buffer_normal import NormalModeMethods
from .core import rules
from .core.call import MaskedCombine, MaskedDispatch
from .engine import masked, static_masked
from .errors import invalid
from .handle import EventHandle, EventOverlap, LowLatencyHandle
from .sizes import get_low_latency_ccl_buffer_size, rdma_size_hint
from .transports import resolve_transport_name
from .transports.failure import resolve_timeout

NAMES = {"expert_ids": "topk_idx", "num_max": "num_max_dispatch_tokens_per_rank", "moe_expert_num": "num_experts",
         "expert_scales": "topk_weights", "recv_stats": "cumulative_local_expert_recv_stats",
         "wait_stats": "dispatch_wait_recv_cost_stats"}  # fmt: skip
COMBINE_NAMES = {**NAMES, "wait_stats": "combine_wait_recv_cost_stats"}


class Buffer(AscendMethods, NormalModeMethods, CompatMethods):
    """The low-latency expert-parallel communication buffer (DeepEP-compatible). Its calls are collective (every rank
    calls, also with 0 tokens): invalid input on any rank raises :class:`MoeDistributeError` (a ValueError) on every
    rank before any received row is placed (from ``hook()`` / the event when deferred); a rank that exits or stops
    calling makes the others raise :class:`EPRankFailure` naming it within about ``timeout`` (``enable_shrink``: they
    mask it and re-run the call). Results alternate between two sets (DeepEP's rule: hold at most 2 low-latency
    results), valid until the next-but-one dispatch.

    Arguments:
        group: the EP ``ProcessGroup`` (required).
        num_rdma_bytes: bytes of the low-latency buffer, or 0 (sized on demand); a call whose
            ``get_low_latency_rdma_size_hint`` exceeds it raises, naming the size needed.
        num_nvl_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted,
            unused (there is no NVLink buffer; only the low-latency mode exists).
        explicitly_destroy: the caller must call :meth:`destroy`; else resources are released with the object.
        enable_shrink: enables the mask buffer (``low_latency_*_mask_buffer``) and, on the reference backend,
            recovery from failed ranks.
        backend (keyword-only, as the rest): ``"reference"`` (our engine), ``"ascend"`` (ops-transformer V3 context
            ops or torch_npu) or ``"auto"`` (``"ascend"`` when torch_npu and an NPU are present).
        ccl_buffer_size: MB of HCCL window the Ascend ops may use (``get_low_latency_ccl_buffer_size``); shapes that
            need more raise, naming the size (ascend backend; flat methods on both). None: the ascend backend checks
            ``HCCL_BUFFSIZE`` if set (torch_npu ops) or sizes the V3 context from the first call's shapes.
        timeout: seconds each collective wait may take. None: ``DEEP_EP_NPU_TIMEOUT``, else 30 s.
        transport: the reference backend's: ``"shm"`` (CPU tensors; rows go through shared-memory windows of
            ``num_rdma_bytes``, at least 1 GiB of address space, among one host's ranks; constructing the Buffer is
            then collective), ``"collective"`` (torch.distributed) or ``"auto"`` (``"shm"`` for a gloo group whose
            ranks all share memory). None: ``DEEP_EP_NPU_TRANSPORT``, else ``"auto"``.
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
        transport: str | None = None,
    ) -> None:
        if group is None:
            raise ValueError("group: a torch.distributed ProcessGroup is required (deep_ep_npu has no mpi4py comm)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if ccl_buffer_size is not None and (not isinstance(ccl_buffer_size, int) or ccl_buffer_size < 1):
            raise ValueError(f"ccl_buffer_size: must be None or a positive int (MB), got {ccl_buffer_size!r}")
        self.backend_name, transport = resolve_backend_name(backend), resolve_transport_name(transport)
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode = num_nvl_bytes, num_rdma_bytes, low_latency_mode
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, enable_shrink
        self._backend = create_backend(
            self.backend_name,
            group,
            timeout=resolve_timeout(timeout),
            enable_shrink=enable_shrink,
            transport=transport,
            num_rdma_bytes=num_rdma_bytes,
            ccl_buffer_size=ccl_buffer_size,
        )
        self.nodes = host_nodes(self._backend)  # (normal mode's intranode / internode form)

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
        topk_weights: torch.Tensor | None = None,
        quant_mode: str | None = None,
        use_mxfp4: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Send each token to the ranks hosting its experts (DeepEP low-latency dispatch). N =
        num_max_dispatch_tokens_per_rank, R ranks, L = num_experts / R local experts.

        Arguments:
            x: `[num_tokens, hidden]` `torch.bfloat16` (or `torch.float16` / `torch.float32`), ``num_tokens <= N``.
            topk_idx: `[num_tokens, num_topk]` `torch.int64` / `torch.int32`, ``num_topk <= 16``; ids in
                ``[0, num_experts)`` or ``-1`` (no expert), an expert at most once per token.
            num_max_dispatch_tokens_per_rank, num_experts: N and the total experts (divisible by R), equal on all ranks.
            cumulative_local_expert_recv_stats: `[L]` `torch.int32` or None; ``recv_count`` is added to it.
            dispatch_wait_recv_cost_stats: `[R]` `torch.int64` or None; the receive wait (ns) is added to every entry.
            use_fp8: quantize to ``quant_format`` (needs ``hidden % 128 == 0``), else keep x's dtype.
            round_scale: round fp8 scales up to powers of two. use_ue8m0: pack them as UE8M0 (needs round_scale and
                ``hidden % 512 == 0``).
            async_finish / return_recv_hook: return an :class:`EventOverlap` whose ``current_stream_wait()`` runs the
                receive / run only the send phase and return the receive as ``hook``; not both.
            quant_format (keyword-only extension): ``"fp8_e4m3"`` (DeepEP's per-128-channel e4m3, the reference
                default) or ``"int8_per_token"`` (Ascend A2/A3's per-token dynamic int8, ``q = rint(x * 127 / amax)``,
                scale ``amax / 127``; the Ascend default). None: the backend's default.
            topk_weights, quant_mode, use_mxfp4 (keyword-only: DeepEP-Ascend's, :mod:`deep_ep_npu.buffer_compat`):
                `[num_tokens, num_topk]` `torch.float32` weights (checked; the ascend backend passes them to the ops as
                their expand scales; combine's ``topk_weights`` weight the sum), ``quant_mode`` None or ``"int8"``
                (= ``use_fp8=True, quant_format="int8_per_token"``), ``use_mxfp4`` False.

        Returns:
            recv_x: `[L, R * N, hidden]` in x's dtype, or with ``use_fp8`` ``(data, scales)``: data
                `[L, R * N, hidden]` `torch.float8_e4m3fn` (`torch.int8` for int8_per_token), scales
                `[L, R * N, hidden // 128]` `torch.float32` (token dim stride 1, as DeepEP; int8: the row's scale
                repeated per group, so ``data * scales`` per 128 channels dequantizes both formats), or with
                ``use_ue8m0`` `[L, R * N, hidden // 512]` `torch.int32`. Rows past ``recv_count`` are undefined.
            recv_count: `[L]` `torch.int32` rows received per local expert.
            handle: :class:`LowLatencyHandle` for ``low_latency_combine``.
            event: :class:`EventOverlap` (meaningful with ``async_finish``). hook: the receive, or None.

        Raises as the class docstring says, also when N / num_experts / hidden / format differ across ranks."""
        self._backend.check_alive(self)
        op, n = "low_latency_dispatch", num_max_dispatch_tokens_per_rank
        with self._backend.rejecting(op):
            rules.overlap_flags(async_finish, return_recv_hook)
            if quant_mode is not None or use_mxfp4 is not False:  # (DeepEP-Ascend's)
                use_fp8, quant_format = ascend_quant(use_fp8, use_mxfp4, quant_mode, quant_format)
            quant = rules.deepep_quant(use_fp8, round_scale, use_ue8m0, quant_format, self._backend.native_quant_format)
            n = rules.count(n, "num_max_dispatch_tokens_per_rank", 1, code="shape")
            experts = rules.plain_experts(self.group_size, self.rank, num_experts, "num_experts")
            call = rules.dispatch(
                MaskedDispatch(
                    op,
                    rules.activations(x),
                    topk_idx,
                    experts,
                    num_max=n,
                    quant=quant,
                    recv_stats=cumulative_local_expert_recv_stats,
                    wait_stats=dispatch_wait_recv_cost_stats,
                    expert_scales=topk_weights,
                    names=NAMES,
                )
            )
            if self.num_rdma_bytes and (need := rdma_size_hint(n, x.shape[1], num_experts)) > self.num_rdma_bytes:
                sizes = f"N={n}, hidden={x.shape[1]}, num_experts={num_experts}: {need} bytes needed"
                why = f"{self.num_rdma_bytes} bytes is too small for {sizes} (Buffer.get_low_latency_rdma_size_hint)"
                raise invalid("num_rdma_bytes", why)
        if masked.static_round(self._backend, call, static_masked.dispatch_bytes):  # (no host read: a graph's)
            inflight = static_masked.dispatch(self._backend, call)
        else:
            inflight = self._backend.dispatch(call)
        event, hook = inflight.overlap(async_finish, return_recv_hook, inflight.value)
        return (*inflight.value, event, hook)  # recv_x, recv_count, handle, event, hook

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
        *,
        slot_order: bool = False,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Return expert outputs to their source ranks and reduce them there (DeepEP low-latency combine).

        Arguments:
            x: `[L, R * N, hidden]` `torch.bfloat16` (or `torch.float16` / `torch.float32`): expert outputs,
                row-aligned with dispatch's ``recv_x``. Ignored with ``zero_copy``.
            topk_idx: `[num_tokens, num_topk]` `torch.int64` / `torch.int32`, the one given to dispatch.
            topk_weights: `[num_tokens, num_topk]` `torch.float32`. handle: the dispatch's handle.
            use_logfmt: DeepEP's LogFMT-10 rows on the wire (:mod:`deep_ep_npu.logfmt`; bf16 x, hidden % 128 == 0,
                not with zero_copy; the reference backend). async_finish, return_recv_hook: as in dispatch.
            zero_copy: combine the bfloat16 buffer from ``get_next_low_latency_combine_buffer(handle)`` (filled by
                the caller) instead of ``x``.
            out: `[num_tokens, hidden]` in x's dtype, written in place and returned, or None.
            combine_wait_recv_cost_stats: `[R]` `torch.int64` or None, as dispatch's ``dispatch_wait_recv_cost_stats``.
            slot_order: (ours) sum each token's rows in slot order (k ascending, as DeepEP's kernel) instead of own
                experts first, then by source rank: the result is then bit for bit independent of where experts
                live, e.g. of which replica ``topk_idx`` picked (``docs/eplb.md``).

        Returns:
            combined_x: `[num_tokens, hidden]` in x's dtype: ``sum_k topk_weights[t, k] * expert_out[t, k]`` over
                ``topk_idx[t, k] >= 0`` (and experts of unmasked ranks), accumulated in fp32; all -1 ids give 0.
            event, hook: as in dispatch.

        Raises as dispatch; MoeDistributeError also for a handle / topk_idx that does not match the dispatch."""
        self._backend.check_alive(self)
        op = "low_latency_combine"
        with self._backend.rejecting(op):
            rules.overlap_flags(async_finish, return_recv_hook)
            use_logfmt, zero_copy = rules.flag(use_logfmt, "use_logfmt"), rules.flag(zero_copy, "zero_copy")
            if use_logfmt and zero_copy:
                raise invalid("use_logfmt", "use_logfmt and zero_copy cannot both be True (as DeepEP); pick one")
            h = rules.masked_handle(handle, self.group_size)
            experts = rules.plain_experts(self.group_size, self.rank, h.num_experts, "handle.num_experts")
            call = rules.combine(
                MaskedCombine(
                    op,
                    x,
                    topk_idx,
                    experts,
                    h,
                    expert_scales=topk_weights,
                    logfmt=use_logfmt,
                    zero_copy=zero_copy,
                    out=out,
                    wait_stats=combine_wait_recv_cost_stats,
                    names=COMBINE_NAMES,
                    slot_order=rules.flag(slot_order, "slot_order"),
                )
            )
        if masked.static_round(self._backend, call, static_masked.combine_bytes):
            inflight = static_masked.combine(self._backend, call)
        else:
            inflight = self._backend.combine(call)
        event, hook = inflight.overlap(async_finish, return_recv_hook, (inflight.value,))
        return inflight.value, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle | tuple) -> torch.Tensor:
        """The `[L, R * N, hidden]` `torch.bfloat16` buffer the next ``zero_copy`` combine reads: fill it, then call
        ``low_latency_combine(..., zero_copy=True)`` with no low-latency call in between (buffers flip per call)."""
        self._backend.check_alive(self)
        return self._backend.next_combine_buffer(rules.masked_handle(handle, self.group_size))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffer state between two barriers (collective; bounded by ``timeout``)."""
        self._backend.check_alive(self)
        self._backend.ep.barrier("clean_low_latency_buffer")
        self._backend.clean()
        self._backend.ep.barrier("clean_low_latency_buffer")

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP's ``EventOverlap(EventHandle())`` of the current stream (already complete: there is no separate
        communication stream)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: DeepEP's SM90-only features (fp8 dispatch, UE8M0 scales) are available here."""
        return True

    def get_comm_stream(self) -> None:
        """None: there is no communication stream (work runs in call order on the calling thread)."""

    def destroy(self) -> None:
        """Release the buffers and communication context; needs ``explicitly_destroy=True`` (as DeepEP). A second call
        is a no-op; using the buffer afterwards raises. Collective (see ``Backend.release``)."""
        self._backend.release(self.explicitly_destroy, called=True)

    def __del__(self) -> None:
        if hasattr(self, "_backend"):
            self._backend.release(self.explicitly_destroy, called=False)

    def _mask(self) -> torch.Tensor:
        if not self.enable_shrink:
            raise RuntimeError("Shrink mode must be enabled: construct the Buffer with enable_shrink=True")
        return self._backend.mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark ``rank_to_mask`` absent (``mask=True``) or present again: no token goes to or comes from a masked
        rank's experts, and a masked rank sends nothing. Every rank must hold the same mask; masked ranks still take
        part in the collectives."""
        mask_buffer = self._mask()
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask: {rank_to_mask} is outside [0, {self.group_size})")
        if not mask and rank_to_mask in self._backend.ep.failed:
            raise ValueError(f"rank_to_mask: rank {rank_to_mask} failed and left the group; it cannot be unmasked")
        mask_buffer[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask into ``mask_status`` `[R]` `torch.int32` (1 = masked)."""
        mask_buffer = self._mask()
        if mask_status.dtype != torch.int32 or tuple(mask_status.shape) != (self.group_size,):
            got = f"{mask_status.dtype} {tuple(mask_status.shape)}"
            raise ValueError(f"mask_status: must be [{self.group_size}] torch.int32, got {got}")
        mask_status.copy_(mask_buffer)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank, except ranks that failed (they left the group and stay masked)."""
        self._mask().zero_()[self._backend.ep.failed] = 1

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of low-latency buffer DeepEP needs for these shapes (its formula; independent of ``num_ranks``)."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    get_low_latency_ccl_buffer_size = staticmethod(get_low_latency_ccl_buffer_size)
    """MB of CCL buffer the Ascend ops need (ops-transformer's formula), e.g. 479 for ``(8, 128, 7168, 256, 8)``."""
