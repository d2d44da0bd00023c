"""The Buffer's Ascend extras: dispatch / combine in the flat layout of ``npu_moe_distribute_dispatch_v2`` (shared /
special experts, int8 quantization) and the fused MegaMoE layer, on the Buffer's group and backend. A mixin of
:class:`deep_ep_npu.Buffer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .backends import Backend, InFlight
from .core import ascend
from .core.call import FFN, FlatCombine, FlatDispatch
from .errors import invalid
from .handle import FlatHandle
from .mega_moe import run as run_mega_moe
from .quant import INT8_PER_TOKEN

FLAT_DISPATCH_OP, FLAT_COMBINE_OP = "moe_distribute_dispatch_v2", "moe_distribute_combine_v2"
FLAT_NAMES = {"scales": "smooth_scales", "expert_scales": "topk_weights", "expert_ids": "topk_idx",
              "global_bs": "num_max_dispatch_tokens_per_rank", "moe_expert_num": "num_experts"}  # fmt: skip
FLAT_COMBINE_NAMES = {"expand_x": "x", "expert_scales": "topk_weights", "expert_ids": "topk_idx",
                      "assist_info_for_combine": "handle", "ep_send_counts": "handle"}  # fmt: skip


class FlatDispatchOutput:
    """``low_latency_dispatch_flat``'s outputs, readable once the receive ran (A = rows this rank can receive, L local
    experts): ``expand_x`` `[A, hidden]` in x's dtype (`torch.int8` with ``quant_mode=2``; rows past the received
    total are zero); ``dynamic_scales`` `[A]` `torch.float32` per-row dequant scales with ``quant_mode=2``;
    ``expert_token_nums`` `[L]` `torch.int64` rows per local expert (counts, or the inclusive cumsum with
    ``expert_token_nums_type=0``: ``npu_grouped_matmul``'s ``group_list``, ``group_list_type`` 1 / 0); ``handle``,
    the :class:`FlatHandle` for ``low_latency_combine_flat``. A view of the call's receive."""

    def __init__(self, inflight: InFlight, handle: FlatHandle) -> None:
        self._inflight, self._handle = inflight, handle

    def _get(self, name: str, index: int) -> Any:
        if not self._inflight.done:
            raise RuntimeError(f"{name} is not received yet: call hook() or event.current_stream_wait() first")
        return self._inflight.value[index]

    expand_x = property(lambda self: self._get("expand_x", 0))
    dynamic_scales = property(lambda self: self._get("dynamic_scales", 1))
    expert_token_nums = property(lambda self: self._get("expert_token_nums", 3))
    handle = property(lambda self: (self._get("handle", 0), self._handle)[1])

    @property
    def pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FlatHandle]:
        """``(expand_x, dynamic_scales, expert_token_nums, handle)`` before the receive ran: the receive fills these
        tensors in place (read them only after it)."""
        value = self._inflight.value
        return value[0], value[1], value[3], self._handle


class AscendMethods:
    """The flat methods and ``mega_moe`` of :class:`deep_ep_npu.Buffer` (on its group and backend)."""

    _backend: Backend
    group: dist.ProcessGroup
    group_size: int
    rank: int

    def low_latency_dispatch_flat(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        *,
        topk_weights: torch.Tensor | None = None,
        quant_mode: int = 0,
        smooth_scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        expert_token_nums_type: int = 1,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        zero_expert_num: int = 0,
        copy_expert_num: int = 0,
        const_expert_num: int = 0,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[FlatDispatchOutput, Any, Callable[[], None] | None]:
        """Dispatch into the flat Ascend layout (``npu_moe_distribute_dispatch_v2`` semantics, A3 fullmesh). Returns
        ``(output, event, hook)``: a :class:`FlatDispatchOutput`, an :class:`EventOverlap`, the receive hook or None.

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` / `torch.float16` (`torch.float32` on the reference backend), T <= N.
            topk_idx: `[T, K]` `torch.int64` / `torch.int32`: routed experts ``[0, num_experts)``, zero experts
                ``[E, E + Z)``, copy ``[E + Z, E + Z + C)``, const experts after them, or ``-1`` (no expert; on the
                NPU mapped onto extra zero experts, see ``backends.ascend.map_no_expert``).
            num_max_dispatch_tokens_per_rank: N, the same on every rank (``global_bs = N * R``). num_experts: routed
                experts (``moe_expert_num``).
            topk_weights: `[T, K]` `torch.float32`, carried to ``handle.expand_scales`` (``expert_scales``).
            quant_mode: 0, or 2 (per-token dynamic int8: ``q = rint(x * 127 / amax)``, scale ``amax / 127``).
            smooth_scales: `[shared_expert_num + num_experts, hidden]` `torch.float32` (the op's ``scales``).
            x_active_mask: `[T]` bool (True first) or `[T, K]` bool. expert_token_nums_type: 1 counts, 0 cumsum.
            shared_expert_num, shared_expert_rank_num, zero/copy/const_expert_num: as in the Ascend op.
            async_finish, return_recv_hook: as in ``low_latency_dispatch``.
        """
        self._backend.check_alive(self)
        n = num_max_dispatch_tokens_per_rank
        global_bs = n * self.group_size if isinstance(n, int) else n
        layout: dict[str, Any] = dict(
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num,
        )
        with self._backend.rejecting(FLAT_DISPATCH_OP, FLAT_NAMES):
            if quant_mode not in (0, 2):
                raise invalid("quant_mode", f"got {quant_mode!r}, allowed 0 or 2")
            experts = ascend.experts(self.group, self.group_size, self.rank, num_experts, **layout)
            call = ascend.dispatch(
                FlatDispatch(
                    FLAT_DISPATCH_OP,
                    x,
                    topk_idx,
                    experts,
                    global_bs=global_bs,
                    x_active_mask=x_active_mask,
                    expert_scales=topk_weights,
                    quant=INT8_PER_TOKEN if quant_mode == 2 else None,
                    scales=smooth_scales,
                    expert_token_nums_type=expert_token_nums_type,
                    ccl_buffer_size=self._backend.ccl_buffer_size,
                    names=FLAT_NAMES,
                )
            )
        inflight = self._backend.dispatch(call)
        _, _, assist, _, ep_recv, tp_recv, expand_scales = inflight.value
        keywords = dict(layout, x_active_mask=x_active_mask, global_bs=global_bs)
        handle = FlatHandle(assist, ep_recv, tp_recv, expand_scales, num_experts, keywords)
        event, hook = inflight.overlap(async_finish, return_recv_hook)
        return FlatDispatchOutput(inflight, handle), event, hook

    def low_latency_combine_flat(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: FlatHandle,
        *,
        shared_expert_x: torch.Tensor | None = None,
        ori_x: torch.Tensor | None = None,
        const_expert_alpha_1: torch.Tensor | None = None,
        const_expert_alpha_2: torch.Tensor | None = None,
        const_expert_v: torch.Tensor | None = None,
        comm_quant_mode: int = 0,
        out: torch.Tensor | None = None,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[torch.Tensor, Any, Callable[[], None] | None]:
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
        self._backend.check_alive(self)
        with self._backend.rejecting(FLAT_COMBINE_OP, FLAT_COMBINE_NAMES):
            if not isinstance(handle, FlatHandle):
                raise invalid("handle", f"must be the FlatHandle from low_latency_dispatch_flat, got {type(handle)}")
            kw = handle.op_kwargs
            layout = {k: v for k, v in kw.items() if k not in ("x_active_mask", "global_bs")}
            experts = ascend.experts(self.group, self.group_size, self.rank, handle.num_experts, combine=True, **layout)
            call = ascend.combine(
                FlatCombine(
                    FLAT_COMBINE_OP,
                    x,
                    topk_idx,
                    experts,
                    (handle.assist_info_for_combine, handle.ep_recv_counts, handle.tp_recv_counts),
                    x_active_mask=kw["x_active_mask"],
                    expert_scales=topk_weights,
                    shared_expert_x=shared_expert_x,
                    ori_x=ori_x,
                    const_expert_alpha_1=const_expert_alpha_1,
                    const_expert_alpha_2=const_expert_alpha_2,
                    const_expert_v=const_expert_v,
                    comm_quant_mode=comm_quant_mode,
                    global_bs=kw["global_bs"],
                    out=out,
                    names=FLAT_COMBINE_NAMES,
                )
            )
        inflight = self._backend.combine(call)
        event, hook = inflight.overlap(async_finish, return_recv_hook, (inflight.value,))
        return inflight.value, event, hook

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
        x_active_mask: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one pipelined call on this Buffer's group and backend:
        :func:`deep_ep_npu.mega_moe.mega_moe` less ``group`` / ``backend`` (it documents every argument; its extra
        keywords ``max_output_size``, ``num_segments``, ``segment_by`` are accepted). x: `[M, K]` `torch.bfloat16` /
        `torch.float16` (`torch.float32` on the reference backend); topk_idx: `[M, topK]` `torch.int32` / `torch.int64`
        (-1: no expert); topk_weights: `[M, topK]` `torch.float32`; w1 `[E_local, K, 2N]`, w2 `[E_local, N, K]`:
        `torch.int8` with `torch.float32` w1_scale `[E_local, 2N]` / w2_scale `[E_local, K]`, else a float dtype;
        x_active_mask: `[M]` `torch.bool` or None. Returns `[M, K]` in ``out_dtype`` (default x's dtype):
        ``sum_k topk_weights[t, k] * FFN_e(x[t])``."""
        self._backend.check_alive(self)
        extra = {k: kwargs.pop(k) for k in ("num_segments", "segment_by", "max_output_size") if k in kwargs}
        ffn = FFN(w1, w2, w1_scale, w2_scale, out_dtype, swiglu_limit, **extra)
        if kwargs:
            raise TypeError(f"mega_moe() got unexpected keyword arguments {sorted(kwargs)}")
        args = (x, topk_idx, topk_weights, ffn, num_max_dispatch_tokens_per_rank, num_experts, x_active_mask)
        return run_mega_moe(self._backend, *args)
