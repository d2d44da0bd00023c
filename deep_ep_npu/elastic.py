"""``deep_ep_npu.ElasticBuffer``: DeepEP V2's ``ElasticBuffer`` (one ``dispatch`` / ``combine`` pair for prefill and
decode, cached handles, the expand layout) on this library's engine or the Ascend ops. Code written for
``deep_ep.ElasticBuffer`` runs unchanged: same constructor, methods, defaults, return tuples and layouts.

What differs (``docs/elastic-buffer.md``): every rank is one scale-up rank (DeepEP's direct mode) and rows are
always in deterministic order; there are no streams, so ``async_with_compute_stream=True`` returns the receive in the
event only when the shapes are known at the send (no CPU sync, or a cached handle); buffer sizes, hybrid-mode, QP and
SM settings are accepted and change nothing. Invalid input on any rank raises :class:`~deep_ep_npu.MoeDistributeError`
on every rank before any payload moves; a rank that exits or stops calling makes the others raise
:class:`~deep_ep_npu.EPRankFailure` within ``timeout``. There is no shrink mode (DeepEP V2 has none).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .backends import create_backend, resolve_backend_name
from .core import elastic as v2
from .core import rules
from .core.call import ExpandCombine, ExpandDispatch
from .errors import invalid
from .handle import EPHandle, EventHandle, EventOverlap
from .sizes import align
from .transports.failure import resolve_timeout

_MIB2 = 2 << 20
DISPATCH_OP, COMBINE_OP = "elastic_dispatch", "elastic_combine"


class ElasticBuffer:
    """DeepEP V2's expert-parallel buffer (see the module docstring for what differs).

    Arguments:
        group: the EP ``ProcessGroup`` (required; the call is collective and ends with a barrier).
        num_bytes: None, or bytes (a multiple of 2 MiB, ``get_buffer_size_hint``); num_cpu_bytes: a multiple of
            2 MiB (no Engram storage). num_max_tokens_per_rank: N, the ``dispatch`` default (0: pass it there).
        hidden, num_topk, use_fp8_dispatch, deterministic, allow_hybrid_mode, sl_idx, num_allocated_qps,
            num_cpu_timeout_secs, num_gpu_timeout_secs: accepted, no-ops here. prefer_overlap_with_compute: only
            changes ``get_theoretical_num_sms``.
        allow_multiple_reduction: an expand combine sums a token's rows on the expert rank before sending (True), or
            sends every row (False; ``topk_weights`` must then be None).
        explicitly_destroy: the caller must call :meth:`destroy`.
        backend (keyword-only, as the rest): ``"reference"`` (the engine), ``"ascend"`` (the MoE distribute ops) or
            ``"auto"``. timeout: seconds per collective wait (None: ``DEEP_EP_NPU_TIMEOUT``, else 30 s).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        backend: str = "auto",
        timeout: float | None = None,
    ) -> None:
        if group is None:
            raise ValueError("group: a torch.distributed ProcessGroup is required")
        for name, value in (("num_bytes", num_bytes), ("num_cpu_bytes", num_cpu_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value % _MIB2):
                raise ValueError(f"{name}: must be an int multiple of 2 MiB ({_MIB2}), got {value!r}")
        for name, value in (
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("hidden", hidden),
            ("num_topk", num_topk),
            ("num_allocated_qps", num_allocated_qps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        self.group, self.rank_idx, self.num_ranks = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_bytes, self.num_max_tokens_per_rank = num_bytes, num_max_tokens_per_rank
        self.hidden, self.num_topk = hidden, num_topk
        self.deterministic, self.allow_multiple_reduction = deterministic, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.explicitly_destroy = prefer_overlap_with_compute, explicitly_destroy
        self.num_allocated_qps = num_allocated_qps or 17
        self.backend_name = resolve_backend_name(backend)
        # rows move by the group's collectives (start_dispatch / start_combine), never by a shared-memory window
        self._backend = create_backend(self.backend_name, group, timeout=resolve_timeout(timeout))
        self._backend.ep.barrier("ElasticBuffer.__init__")

    def destroy(self) -> None:
        """Release the buffer; needs ``explicitly_destroy=True``. A second call is a no-op; using the buffer afterwards
        raises. Collective (see ``Backend.release``)."""
        self._backend.release(self.explicitly_destroy, called=True)

    def __del__(self) -> None:
        if hasattr(self, "_backend"):
            self._backend.release(self.explicitly_destroy, called=False)

    @property
    def rank(self) -> int:
        return self.rank_idx

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes of buffer these shapes need, by DeepEP's direct-mode model, 2 MiB-aligned: dispatch receives
        ``R * N`` tokens (bf16 ``2 * hidden`` bytes, or fp8 ``hidden`` + ``ceil(hidden / 32)`` 4-byte scale packs,
        plus 12 bytes per top-k entry and 8 of metadata), combine ``min(R, K) * N`` bf16 rows (``K * N`` without
        multiple reduction); ``num_topk=0`` counts as 32. Advisory here (the wire buffers grow on demand)."""
        r, k = dist.get_world_size(group), num_topk or 32
        token = (hidden + 4 * math.ceil(hidden / 32) if use_fp8_dispatch else 2 * hidden) + 12 * k + 8
        combine_rows = (min(r, k) if allow_multiple_reduction else k) * num_max_tokens_per_rank
        return align(max(r * num_max_tokens_per_rank * token, combine_rows * 2 * hidden), _MIB2)

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """A constant here (no SMs to share): 20, or 64 with ``prefer_overlap_with_compute=False`` (DeepEP's floor
        then); even and >= 4 as DeepEP's. Stored in the handle as ``num_sms``; changes nothing."""
        return 20 if self.prefer_overlap_with_compute else 64

    @staticmethod
    def get_theoretical_num_qps(num_sms: int) -> int:
        """DeepEP's direct-mode rule, ``min(num_sms, 9)`` (no QPs here)."""
        return min(num_sms, 9)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out, scale-up) ranks: ``(1, R)``, every rank one scale-up peer (DeepEP's direct mode)."""
        return 1, self.num_ranks

    get_physical_domain_size = get_logical_domain_size

    @staticmethod
    def capture() -> EventHandle:
        """An :class:`EventHandle` of the current stream (already complete; for ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self) -> None:
        """There is no separate communication stream (work runs in call order); returns None."""
        return None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier of the group's ranks, bounded by ``timeout`` (the arguments are accepted, no-ops)."""
        self._backend.check_alive(self)
        self._backend.ep.barrier("barrier")

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send each token to the ranks hosting its experts (collective). R ranks, L = num_experts / R, T tokens,
        N = num_max_tokens_per_rank, K top-k, ``a`` = expert_alignment, num_recv / num_expanded the received rows:
        exact with CPU sync, else ``R * N`` / ``align(R * N * min(K, L) + (a - 1) * L, a)``, whose tail past the real
        total (``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``) is unspecified in the rows (as DeepEP's), 0 in
        the weights and -1 in ``recv_topk_idx`` and ``recv_src_metadata``.

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` (`torch.float16` / `torch.float32` also), or the pre-quantized tuple
                (`[T, hidden]` `torch.float8_e4m3fn`, scale factors `[T, S]` `torch.float32` / `torch.int32`),
                passed through unchanged (nothing is cast). ``T <= N``.
            topk_idx: `[T, K]` `torch.int64` (``topk_idx_t``) or `torch.int32`, ``K <= 32``, ids in
                ``[0, num_experts)`` or -1, distinct per token; None with a cached ``handle``.
            topk_weights: `[T, K]` `torch.float32` or None, carried to ``recv_topk_weights``.
            cumulative_local_expert_recv_stats: `[L]` `torch.int32`; the unaligned counts are added (not with a handle).
            num_experts, num_max_tokens_per_rank (default: the constructor's), expert_alignment (default 1): the same
                on every rank; with a handle, None or the handle's.
            handle: a cached :class:`EPHandle` of this buffer: its layout is reused with no count exchange and rows
                land at the same positions; T, K, ``do_expand`` and the values above must be the handle's.
            do_handle_copy: the handle keeps a clone of ``topk_idx`` (else ``topk_idx`` itself).
            do_cpu_sync: exact shapes (True, the default without a handle) or worst-case ones (False).
            do_expand: the expand layout. do_zero_padding: zero its alignment padding (data, weights, sf).
            use_tma_aligned_col_major_sf: ``recv_sf`` with strides ``(1, align(rows, 4))``.
            async_with_compute_stream: return the receive in the event (see the module docstring).
            num_sms, num_qps, previous_event (an :class:`EventHandle`; needs ``allocate_on_comm_stream``),
                previous_event_before_epilogue, allocate_on_comm_stream: accepted (no streams here).

        Returns:
            recv_x: non-expand `[num_recv, hidden]`, one row per (source token, this rank), grouped by source rank
                (boundaries ``handle.psum_num_recv_tokens_per_scaleup_rank``), tokens ascending; expand
                `[num_expanded, hidden]`, one row per (token, local expert), expert i's rows from
                ``align(psum[i - 1], a)``. In x's dtype, or ``(data, sf)`` as x was.
            recv_topk_idx: non-expand `[num_recv, K]` in topk_idx's dtype, the local expert ids (-1: not here);
                expand: None.
            recv_topk_weights: `[num_recv, K]` `torch.float32` (the sender's row) or expand `[num_expanded]` (the
                row's weight); None without ``topk_weights``.
            handle: the :class:`EPHandle` (a cached call returns the same object). event: :class:`EventOverlap`.
        """
        self._backend.check_alive(self)
        with self._backend.rejecting(DISPATCH_OP):
            data, sf = v2.split_x(x)
            rules.flag(do_handle_copy, "do_handle_copy")
            rules.flag(do_expand, "do_expand")
            rules.flag(do_zero_padding, "do_zero_padding")
            rules.flag(use_tma_aligned_col_major_sf, "use_tma_aligned_col_major_sf")
            if do_cpu_sync is not None:
                rules.flag(do_cpu_sync, "do_cpu_sync")
            if do_zero_padding and not do_expand:
                why = "zeroes the expand layout's alignment padding: it needs do_expand=True"
                raise invalid("do_zero_padding", why)
            if handle is None:  # a fresh layout
                h = None
                experts = v2.experts_of(num_experts, self.num_ranks, self.rank_idx)
                a = rules.count(1 if expert_alignment is None else expert_alignment, "expert_alignment", 1)
                n = v2.num_max(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
                ids = rules.tensor(topk_idx, "topk_idx", rules.ID_DTYPES, 2)  # (its values: rules.dispatch)
                expand, cpu_sync = do_expand, do_cpu_sync is not False
            else:  # the cached handle's
                h = v2.owned_handle(handle, self._backend)
                experts = rules.plain_experts(self.num_ranks, self.rank_idx, h.num_experts, "num_experts")
                a, n = h.expert_alignment, h.num_max_tokens_per_rank
                ids, expand, cpu_sync = h.topk_idx, h.do_expand, False
            call = ExpandDispatch(
                DISPATCH_OP,
                data,
                ids,
                experts,
                num_max=n,
                expert_scales=topk_weights,
                x_sf=sf,
                recv_stats=cumulative_local_expert_recv_stats,
                alignment=a,
                do_expand=expand,
                zero_padding=do_zero_padding,
                tma_sf=use_tma_aligned_col_major_sf,
                cpu_sync=cpu_sync,
                cached=h,
                handle_copy=do_handle_copy,
                names=v2.NAMES,
            )
            if h is not None:
                v2.cached(
                    call, h, topk_idx, do_cpu_sync, num_experts, expert_alignment, num_max_tokens_per_rank, do_expand
                )
            call = rules.dispatch(call)
            rules.flag(async_with_compute_stream, "async_with_compute_stream")
            rules.flag(allocate_on_comm_stream, "allocate_on_comm_stream")
            v2.events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream, num_sms, num_qps)
        num_sms = num_sms or self.get_theoretical_num_sms(call.experts.num_moe_experts, call.expert_ids.shape[1])
        inflight = self._backend.dispatch(call)
        async_finish = async_with_compute_stream and not call.cpu_sync
        out = inflight.value if async_finish else inflight.wait()
        out.handle.num_sms = out.handle.num_sms or num_sms  # (as DeepEP: the dispatch's SMs)
        recv_x = out.x if out.sf is None else (out.x, out.sf)
        recv_topk_idx = None if out.topk_idx is None else out.topk_idx.to(call.expert_ids.dtype)
        weights = out.weights if topk_weights is not None else None
        return recv_x, recv_topk_idx, weights, out.handle, EventOverlap(inflight if async_finish else None)

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return rows to their source ranks and sum them there (collective): no weights are applied.

        Arguments:
            x: non-expand `[handle.num_recv_tokens, hidden]`, one pre-reduced (pre-weighted) row per received token,
                row-aligned with ``recv_x``; expand `[handle.num_expanded_tokens, hidden]`, one row per expand row.
                `torch.bfloat16` (`torch.float16` / `torch.float32` also). Tail and padding rows are ignored.
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: non-expand `[num_recv, K]` / expand `[num_expanded]` `torch.float32`, or None: each slot's
                value travels back from its expert's rank (``combined_topk_weights``).
            bias: None, or one or two `[T, hidden]` tensors in x's dtype, added first (in fp32).
            num_sms, num_qps, previous_event, previous_event_before_epilogue, allocate_on_comm_stream: as dispatch.
            async_with_compute_stream: return the receive in the event.

        Returns:
            combined_x: `[T, hidden]` in x's dtype: ``bias0 + bias1 + sum`` of the returned rows in fp32 (each rank's
                row in the order of its last top-k slot), rounded once.
            combined_topk_weights: `[T, K]` `torch.float32` (0 for ``topk_idx == -1``), or None.
            event: :class:`EventOverlap`.
        """
        self._backend.check_alive(self)
        with self._backend.rejecting(COMBINE_OP):
            rules.flag(async_with_compute_stream, "async_with_compute_stream")
            v2.events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream, num_sms, num_qps)
            h = v2.owned_handle(handle, self._backend)
            experts = rules.plain_experts(self.num_ranks, self.rank_idx, h.num_experts, "num_experts")
            call = ExpandCombine(COMBINE_OP, x, h.topk_idx, experts, h, expert_scales=topk_weights)
            call = v2.combine(call, self.allow_multiple_reduction, bias)
        inflight = self._backend.combine(call)
        combined, weights = inflight.value if isinstance(inflight.value, tuple) else (inflight.value, None)
        if not async_with_compute_stream:
            inflight.wait()
            return combined, weights, EventOverlap(None)
        return combined, weights, EventOverlap(inflight, (combined,))
