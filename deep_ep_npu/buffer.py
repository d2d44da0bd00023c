"""``deep_ep_npu.Buffer``: DeepEP's low-latency ``Buffer`` on Ascend NPUs or any torch.distributed group. Code written
for ``deep_ep.Buffer`` in low-latency mode runs unchanged (same constructor, method signatures, defaults, return
tuples and layouts); a backend picked by name does the work.

Overlap, as in DeepEP: with ``return_recv_hook=True`` a call runs only the send phase and returns ``hook``, and
``hook()`` runs the receive; with ``async_finish=True`` the returned :class:`EventOverlap` runs it on
``current_stream_wait()`` (or at the end of a ``with event:`` block). Compute placed in between overlaps::

    recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, N, E, return_recv_hook=True)
    y_other = attention_of_the_other_micro_batch()    # overlaps the dispatch
    hook()                                            # recv_x / recv_count / handle are valid from here on

Buffer reuse (DeepEP's rule: hold at most 2 low-latency results at a time): the communication buffers flip on every
dispatch and combine, and dispatch results (``recv_x``, its scales, ``recv_count``, the handle's tensors) alternate
between two sets, valid until the next-but-one dispatch. Finish a call's receive before the next-but-one call.

Failures: the calls are collective (every rank calls, also with 0 tokens). Invalid input on any rank raises
:class:`MoeDistributeError` (a ValueError) on every rank before any received row is placed (a peer's rejection is
raised by the receive: ``hook()`` / the event with ``return_recv_hook`` / ``async_finish``). A rank that exits or
stops calling makes every other rank raise :class:`deep_ep_npu.EPRankFailure` (a RuntimeError) naming it, from the
call or its ``hook()`` / event, within about ``timeout`` (never a hang); with ``enable_shrink`` (reference backend)
the survivors instead agree on the failed ranks, continue on a group of themselves, mask them and re-run the
interrupted call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import ll_params, profiling
from .backends import BufferConfig, create_backend, resolve_backend_name
from .engine.transport import resolve_transport_name
from .errors import MoeDistributeError, invalid, shape
from .event import Completion, EventOverlap
from .failure import resolve_timeout
from .handle import FlatHandle, LowLatencyHandle
from .lifecycle import Destroyable
from .normal_mode import Config, get_dispatch_layout, normal_mode_error
from .params import CombineParams, DispatchParams
from .sizes import get_low_latency_ccl_buffer_size, rdma_size_hint

# the flat methods' parameter names for the ops' names that errors carry
_FLAT_DISPATCH_NAMES = {"scales": "smooth_scales", "expert_scales": "topk_weights", "expert_ids": "topk_idx",
                        "global_bs": "num_max_dispatch_tokens_per_rank", "moe_expert_num": "num_experts"}  # fmt: skip
_FLAT_COMBINE_NAMES = {"expand_x": "x", "expert_scales": "topk_weights", "expert_ids": "topk_idx",
                       "assist_info_for_combine": "handle", "ep_send_counts": "handle"}  # fmt: skip


class FlatDispatchOutput:
    """``low_latency_dispatch_flat``'s outputs, readable once the receive ran (A = rows this rank can receive, L local
    experts): ``expand_x`` `[A, hidden]` in x's dtype (`torch.int8` with ``quant_mode=2``; rows past the received
    total are unspecified); ``dynamic_scales`` `[A]` `torch.float32` per-row dequant scales with ``quant_mode=2``;
    ``expert_token_nums`` `[L]` `torch.int64` rows per local expert (counts, or the inclusive cumsum with
    ``expert_token_nums_type=0``: ``npu_grouped_matmul``'s ``group_list``, ``group_list_type`` 1 / 0); ``handle``,
    the :class:`FlatHandle` for ``low_latency_combine_flat``."""

    _values: dict[str, Any] | None = None  # set by the receive

    def _get(self, name: str) -> Any:
        if self._values is None:
            raise RuntimeError(f"{name} is not received yet: call hook() or event.current_stream_wait() first")
        return self._values[name]

    expand_x = property(lambda self: self._get("expand_x"))
    dynamic_scales = property(lambda self: self._get("dynamic_scales"))
    expert_token_nums = property(lambda self: self._get("expert_token_nums"))
    handle = property(lambda self: self._get("handle"))


class Buffer(Destroyable):
    """The low-latency expert-parallel communication buffer (DeepEP-compatible).

    Arguments:
        group: the EP ``ProcessGroup`` (required).
        num_rdma_bytes: bytes of the low-latency buffer; 0 lets the backend size it on demand. When > 0, a call
            whose ``get_low_latency_rdma_size_hint`` exceeds it raises, naming the size needed.
        num_nvl_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted
            for compatibility, unused (there is no NVLink buffer; only the low-latency mode is implemented).
        explicitly_destroy: the caller must call :meth:`destroy`; else resources are released with the object.
        enable_shrink: enables the mask buffer (``low_latency_update/query/clean_mask_buffer``) and, on the
            reference backend, recovery from failed ranks.
        backend (keyword-only, as the rest): ``"reference"`` (torch.distributed), ``"ascend"`` (ops-transformer V3
            context ops or torch_npu) or ``"auto"`` (``"ascend"`` when torch_npu and an NPU are present).
        ccl_buffer_size: MB of HCCL window the Ascend ops may use (``get_low_latency_ccl_buffer_size``); shapes that
            need more raise, naming the size (ascend backend; flat methods on both). None: the ascend backend checks
            ``HCCL_BUFFSIZE`` if set (torch_npu ops) or sizes the V3 context from the first call's shapes.
        timeout: seconds each collective wait may take (a failed peer is detected within about this). None:
            ``DEEP_EP_NPU_TIMEOUT``, else 30 s (DeepEP's kernels: ~100 s).
        transport: how the reference backend moves rows: ``"shm"`` (a shared-memory window of the ranks of one host:
            senders write rows into the receivers' windows, signals carry the counts; CPU tensors), ``"collective"``
            (torch.distributed) or ``"auto"`` (``"shm"`` when the group is gloo and every rank can share memory with
            every other, else ``"collective"``). None: ``DEEP_EP_NPU_TRANSPORT``, else ``"auto"``. Constructing the
            Buffer is then collective (the ranks map each other's windows). The window is ``num_rdma_bytes`` (at
            least 1 GiB of address space, allocated as touched).
    """

    num_sms: int = 20

    def __init__(
        self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
        low_latency_mode: bool = False, num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
        backend: str = "auto", ccl_buffer_size: int | None = None, timeout: float | None = None,
        transport: str | None = None,
    ) -> None:  # fmt: skip
        if group is None:
            raise ValueError("group: a torch.distributed ProcessGroup is required (deep_ep_npu has no mpi4py comm)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if ccl_buffer_size is not None and (not isinstance(ccl_buffer_size, int) or ccl_buffer_size < 1):
            raise ValueError(f"ccl_buffer_size: must be None or a positive int (MB), got {ccl_buffer_size!r}")
        self.config = BufferConfig(
            num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
            allow_mnnvl, explicitly_destroy, enable_shrink, ccl_buffer_size, resolve_timeout(timeout),
            resolve_transport_name(transport),
        )  # fmt: skip
        self.backend_name = resolve_backend_name(backend)
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode = num_nvl_bytes, num_rdma_bytes, low_latency_mode
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, enable_shrink
        self._backend = create_backend(self.backend_name, group, self.config)
        self._destroyed = False

    def _validated(self, op: str, call: dict[str, Any]) -> Any:
        """``op``'s arguments (its ``locals()``) validated; on failure, tells the peers (they raise too) and raises."""
        self._check_alive()
        lap, call = profiling.laps(op), {k: v for k, v in call.items() if k != "self"}
        try:
            if op == "combine":
                args: Any = ll_params.CombineArgs(**call, num_ranks=self.group_size).validate()
            else:
                native = self._backend.native_quant_format
                args = ll_params.DispatchArgs(**call, num_ranks=self.group_size, native_quant_format=native).validate()
                n, hidden, num_experts = args.num_max_dispatch_tokens_per_rank, args.hidden, args.num_experts
                if self.num_rdma_bytes and (need := rdma_size_hint(n, hidden, num_experts)) > self.num_rdma_bytes:
                    sizes = f"N={n}, hidden={hidden}, num_experts={num_experts}: {need} bytes needed"
                    msg = f"{self.num_rdma_bytes} bytes is too small for {sizes}"
                    raise invalid("num_rdma_bytes", f"{msg} (Buffer.get_low_latency_rdma_size_hint)")
        except MoeDistributeError as err:
            self._backend.abort(op, err.code)
            raise
        lap("validation")
        return args

    @staticmethod
    def _overlap(completion: Completion, async_finish: bool, return_recv_hook: bool, tensors: tuple):
        if return_recv_hook:
            return EventOverlap(None), completion
        if async_finish:
            return EventOverlap(completion, tensors), None
        completion.wait()
        return EventOverlap(None), None

    def low_latency_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True, round_scale: bool = False,
        use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False, *,
        quant_format: str | None = None,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:  # fmt: skip
        """Send each token to the ranks hosting its experts (DeepEP low-latency dispatch). N =
        num_max_dispatch_tokens_per_rank, R ranks, L = num_experts / R local experts.

        Arguments:
            x: `[num_tokens, hidden]` `torch.bfloat16` (or `torch.float16` / `torch.float32`), ``num_tokens <= N``.
            topk_idx: `[num_tokens, num_topk]` `torch.int64` / `torch.int32`, ``num_topk <= 16``; ids in
                ``[0, num_experts)`` or ``-1`` (no expert), an expert at most once per token.
            num_max_dispatch_tokens_per_rank, num_experts: N and the total experts (divisible by R), equal on all ranks.
            cumulative_local_expert_recv_stats: `[L]` `torch.int32` or None; ``recv_count`` is added to it.
            dispatch_wait_recv_cost_stats: `[R]` `torch.int64` or None; the nanoseconds this rank waited for the
                receive are added to every entry (a collective completes for all sources at once).
            use_fp8: quantize to ``quant_format`` (needs ``hidden % 128 == 0``), else keep x's dtype.
            round_scale: round fp8 scales up to powers of two. use_ue8m0: pack them as UE8M0 (needs round_scale and
                ``hidden % 512 == 0``).
            async_finish / return_recv_hook: return an event / a ``hook`` that completes the receive; not both.
            quant_format (keyword-only extension): ``"fp8_e4m3"`` (DeepEP's per-128-channel e4m3, the reference
                default) or ``"int8_per_token"`` (Ascend A2/A3's per-token dynamic int8, ``q = rint(x * 127 / amax)``,
                scale ``amax / 127``; the Ascend default). None: the backend's default.

        Returns:
            recv_x: `[L, R * N, hidden]` in x's dtype, or with ``use_fp8`` ``(data, scales)``: data
                `[L, R * N, hidden]` `torch.float8_e4m3fn` (`torch.int8` for int8_per_token), scales
                `[L, R * N, hidden // 128]` `torch.float32` (token dim stride 1, as DeepEP; int8: the row's scale
                repeated per group, so ``data * scales`` per 128 channels dequantizes both formats), or with
                ``use_ue8m0`` `[L, R * N, hidden // 512]` `torch.int32`. Rows past ``recv_count`` are undefined.
            recv_count: `[L]` `torch.int32` rows received per local expert.
            handle: :class:`LowLatencyHandle` for ``low_latency_combine``.
            event: :class:`EventOverlap` (meaningful with ``async_finish``). hook: the receive, or None.

        Raises MoeDistributeError / EPRankFailure as the module docstring says; the former also when N / num_experts
        / hidden / format differ across ranks."""
        res = self._backend.dispatch(self._validated("dispatch", locals()))
        event, hook = self._overlap(res.completion, async_finish, return_recv_hook, res[:3])
        return res.recv_x, res.recv_count, res.handle, event, hook

    def low_latency_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle | tuple,
        use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
        out: torch.Tensor | None = None, combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:  # fmt: skip
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
            combine_wait_recv_cost_stats: `[R]` `torch.int64`; the receive wait (ns) is added to every entry.

        Returns:
            combined_x: `[num_tokens, hidden]` in x's dtype: ``sum_k topk_weights[t, k] * expert_out[t, k]`` over
                ``topk_idx[t, k] >= 0`` (and experts of unmasked ranks), accumulated in fp32; all -1 ids give 0.
            event, hook: as in dispatch.

        Raises as dispatch; MoeDistributeError also for a handle / topk_idx that does not match the dispatch."""
        res = self._backend.combine(self._validated("combine", locals()))
        event, hook = self._overlap(res.completion, async_finish, return_recv_hook, (res.combined_x,))
        return res.combined_x, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle | tuple) -> torch.Tensor:
        """The `[L, R * N, hidden]` `torch.bfloat16` buffer the next ``zero_copy`` combine reads: fill it, then call
        ``low_latency_combine(..., zero_copy=True)`` with no low-latency call in between (buffers flip per call)."""
        self._check_alive()
        return self._backend.next_combine_buffer(ll_params.validate_handle(handle, self.group_size))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffer state between two barriers (collective; bounded by ``timeout``)."""
        self._check_alive()
        self._backend.ep.barrier("clean_low_latency_buffer")
        self._backend.clean()
        self._backend.ep.barrier("clean_low_latency_buffer")

    def low_latency_dispatch_flat(
        self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
        topk_weights: torch.Tensor | None = None, quant_mode: int = 0, smooth_scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None, expert_token_nums_type: int = 1, shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0, zero_expert_num: int = 0, copy_expert_num: int = 0,
        const_expert_num: int = 0, async_finish: bool = False, return_recv_hook: bool = False,
    ) -> tuple[FlatDispatchOutput, EventOverlap, Callable[[], None] | None]:  # fmt: skip
        """Dispatch into the flat Ascend layout (``npu_moe_distribute_dispatch_v2`` semantics, A3 fullmesh). Returns
        ``(output, event, hook)``: a :class:`FlatDispatchOutput`, an :class:`EventOverlap`, the receive hook or None.

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` / `torch.float16` (`torch.float32` on the reference backend), T <= N.
            topk_idx: `[T, K]` `torch.int64` / `torch.int32`: routed experts ``[0, num_experts)``, zero experts
                ``[E, E + Z)``, copy ``[E + Z, E + Z + C)``, const experts after them, or ``-1`` (no expert; mapped
                onto extra zero experts, see ``backends.map_no_expert``).
            num_max_dispatch_tokens_per_rank: N, the same on every rank (``global_bs = N * R``). num_experts: routed
                experts (``moe_expert_num``).
            topk_weights: `[T, K]` `torch.float32`, carried to ``handle.expand_scales`` (``expert_scales``).
            quant_mode: 0, or 2 (per-token dynamic int8: ``q = rint(x * 127 / amax)``, scale ``amax / 127``).
            smooth_scales: `[shared_expert_num + num_experts, hidden]` `torch.float32` (the op's ``scales``).
            x_active_mask: `[T]` bool (True first) or `[T, K]` bool. expert_token_nums_type: 1 counts, 0 cumsum.
            shared_expert_num, shared_expert_rank_num, zero/copy/const_expert_num: as in the Ascend op.
            async_finish, return_recv_hook: as in ``low_latency_dispatch``.
        """
        self._check_alive()
        n = num_max_dispatch_tokens_per_rank
        layout = dict(
            x_active_mask=x_active_mask, shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num, global_bs=n * self.group_size if isinstance(n, int) else n,
            zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num,
        )  # fmt: skip
        params = DispatchParams(
            x, topk_idx, self.group, self.group_size, self.rank, num_experts, scales=smooth_scales,
            expert_scales=topk_weights, quant_mode=quant_mode, expert_token_nums_type=expert_token_nums_type,
            ccl_buffer_size=self.config.ccl_buffer_size, no_expert=True, **layout,
        )  # fmt: skip
        if quant_mode not in (0, 2):
            self._reject_flat("dispatch_flat", invalid("quant_mode", f"got {quant_mode!r}, allowed 0 or 2"))
        try:
            pending = self._backend.dispatch_flat(params)
        except MoeDistributeError as err:
            raise err.renamed(_FLAT_DISPATCH_NAMES) from None
        result = FlatDispatchOutput()

        def finish() -> None:
            expand_x, scales, assist, token_nums, ep_recv, tp_recv, expand_scales = pending.wait()
            handle = FlatHandle(assist, ep_recv, tp_recv, expand_scales, num_experts, layout)
            result._values = dict(expand_x=expand_x, dynamic_scales=scales, expert_token_nums=token_nums, handle=handle)

        event, hook = self._overlap(Completion(finish), async_finish, return_recv_hook, ())
        return result, event, hook

    def low_latency_combine_flat(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: FlatHandle, *,
        shared_expert_x: torch.Tensor | None = None, ori_x: torch.Tensor | None = None,
        const_expert_alpha_1: torch.Tensor | None = None, const_expert_alpha_2: torch.Tensor | None = None,
        const_expert_v: torch.Tensor | None = None, comm_quant_mode: int = 0, out: torch.Tensor | None = None,
        async_finish: bool = False, return_recv_hook: bool = False,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:  # fmt: skip
        """Combine flat expert outputs (``npu_moe_distribute_combine_v2`` semantics). Returns ``(combined_x, event,
        hook)``, combined_x `[T, hidden]` in x's dtype (filled once the receive ran).

        Arguments:
            x: `[A, hidden]` expert outputs row-aligned with ``expand_x`` (`torch.bfloat16` / `torch.float16`).
            topk_idx: `[T, K]`, the one given to ``low_latency_dispatch_flat``. topk_weights: `[T, K]` fp32.
            handle: the dispatch's :class:`FlatHandle`. shared_expert_x: `[T, hidden]` in x's dtype, weight 1.
            ori_x: `[T, hidden]` (copy / const experts); const_expert_alpha_1/_2, const_expert_v:
                `[const_expert_num, hidden]`. comm_quant_mode: 0, or 2 (int8 on the wire).
            out: `[T, hidden]` in x's dtype, written in place, or None.
        """
        self._check_alive()
        if not isinstance(handle, FlatHandle):
            bad = f"must be the FlatHandle from low_latency_dispatch_flat, got {type(handle)}"
            self._reject_flat("combine_flat", invalid("handle", bad))
        if out is not None and isinstance(x, torch.Tensor) and isinstance(topk_idx, torch.Tensor):
            want = (topk_idx.shape[0], x.shape[-1])
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype:
                got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out)
                self._reject_flat("combine_flat", shape("out", f"got {got}, expected shape {want} in {x.dtype}"))
        params = CombineParams(
            x, topk_idx, handle.assist_info_for_combine, handle.ep_recv_counts, topk_weights, self.group,
            self.group_size, self.rank, handle.num_experts,
            expand_scales=handle.expand_scales if handle.expand_scales.numel() else None,
            shared_expert_x=shared_expert_x, ori_x=ori_x, const_expert_alpha_1=const_expert_alpha_1,
            const_expert_alpha_2=const_expert_alpha_2, const_expert_v=const_expert_v,
            comm_quant_mode=comm_quant_mode, no_expert=True, **handle.op_kwargs,
        )  # fmt: skip
        try:
            pending = self._backend.combine_flat(params)
        except MoeDistributeError as err:
            raise err.renamed(_FLAT_COMBINE_NAMES) from None
        combined = out if out is not None else x.new_empty((topk_idx.shape[0], x.shape[1]))

        def finish() -> None:
            combined.copy_(pending.wait())

        event, hook = self._overlap(Completion(finish), async_finish, return_recv_hook, (combined,))
        return combined, event, hook

    def _reject_flat(self, op: str, err: MoeDistributeError) -> NoReturn:
        """Tell the peers that this rank rejected its input to ``op`` (they raise too), then raise ``err``."""
        self._backend.abort(op, err.code)
        raise err

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

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Accepted for compatibility (DeepEP's normal kernels only; nothing to set here)."""
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An already-complete event (there is no separate communication stream to capture)."""
        return EventOverlap(None)

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    def get_comm_stream(self) -> None:
        """DeepEP's communication stream: there is none here (work runs in call order on the calling thread; results
        are ready when the call, its ``hook()`` or its event returns), so this returns None."""
        return None

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None, async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:  # fmt: skip
        """DeepEP's normal-mode layout helper, computed locally (no communication): ``num_tokens_per_rank`` `[R]`
        `torch.int32`, ``num_tokens_per_rdma_rank`` None, ``num_tokens_per_expert`` `[num_experts]` `torch.int32`,
        ``is_token_in_rank`` `[T, R]` `torch.bool`, a complete event (``normal_mode.get_dispatch_layout``)."""
        self._check_alive()
        return get_dispatch_layout(topk_idx, num_experts, self.group_size)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """Normal-mode dispatch: not implemented; raises NotImplementedError pointing to :class:`ElasticBuffer`."""
        raise normal_mode_error("dispatch")

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        """Normal-mode combine: not implemented; raises NotImplementedError pointing to :class:`ElasticBuffer`."""
        raise normal_mode_error("combine")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A default :class:`Config` (accepted by nothing here: normal mode is not implemented)."""
        return Config()

    get_combine_config = get_dispatch_config

    def mega_moe(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
        *, w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
        num_max_dispatch_tokens_per_rank: int, num_experts: int, out_dtype: torch.dtype | None = None,
        x_active_mask: torch.Tensor | None = None, swiglu_limit: float | None = None, **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        """dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one pipelined call on this Buffer's group and backend:
        :func:`deep_ep_npu.mega_moe.mega_moe`, which documents the math and the extra keywords (``max_output_size``,
        ``num_segments``, ``segment_by``). x: `[M, K]` `torch.bfloat16` / `torch.float16` (`torch.float32` on the
        reference backend); topk_idx: `[M, topK]` `torch.int32` / `torch.int64` (-1: no expert); topk_weights:
        `[M, topK]` `torch.float32`; w1: `[E_local, K, 2N]` (gate then up), `torch.int8` when scales are given, else a
        float dtype; w2: `[E_local, N, K]`, w1's dtype; w1_scale `[E_local, 2N]` / w2_scale `[E_local, K]`:
        `torch.float32` per-channel scales, or None; x_active_mask: `[M]` `torch.bool` prefix of active tokens (the
        others are not dispatched, their ids are not checked, their rows are 0), or None; swiglu_limit: the SwiGLU
        clamp L (> 0: ``gate <= L``, ``|up| <= L``), None or 0.0: none. Returns `[M, K]` in ``out_dtype`` (default x's
        dtype): ``sum_k topk_weights[t, k] * FFN_e(x[t])``."""
        from .mega_moe.api import run_mega_moe

        self._check_alive()
        return run_mega_moe(
            self._backend.ep, self.backend_name, x, topk_idx, topk_weights, w1, w2,
            transport=getattr(self._backend, "transport", None), w1_scale=w1_scale,
            w2_scale=w2_scale, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, out_dtype=out_dtype, x_active_mask=x_active_mask, swiglu_limit=swiglu_limit,
            **kwargs,
        )  # fmt: skip
