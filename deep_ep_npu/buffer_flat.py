"""The Ascend-native extras of :class:`deep_ep_npu.Buffer`: the flat layout of the MoE distribute V2/V3 ops.

``low_latency_dispatch_flat`` / ``low_latency_combine_flat`` keep DeepEP's call shape (``x, topk_idx, N,
num_experts``; ``-1`` = no expert; ``async_finish`` / ``return_recv_hook``) but return the Ascend layout:
``expand_x`` `[A, hidden]` (rows expert-major, then source rank, then token) with ``expert_token_nums`` ready as
a grouped-matmul ``group_list``, and expose what only the Ascend ops have: per-token int8 quant with smoothing
scales, shared experts (``shared_expert_x``, shared-expert ranks), zero / copy / const experts and
``x_active_mask``. They run ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` (the Ascend backend) or their
torch.distributed reimplementation :mod:`deep_ep_npu.ops` (the reference backend, two-stage ``*_setup`` form).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .backends.base import map_no_expert
from .event import Completion, EventOverlap
from .handle import FlatHandle


def _op_ids(topk_idx: object, num_experts: int, zero_expert_num: int) -> tuple[object, int]:
    """``-1`` mapped onto zero experts; anything that is not a 2-D int tensor goes to the op unchanged, so that the op
    rejects it on every rank (a local error here would leave the peers waiting)."""
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 and topk_idx.dtype in (torch.int32, torch.int64):
        return map_no_expert(topk_idx, num_experts, zero_expert_num)
    return topk_idx, zero_expert_num


class FlatDispatchOutput:
    """The outputs of ``low_latency_dispatch_flat``; readable once the receive ran (at once, or after ``hook()`` /
    the event's wait).

    Attributes (A = rows this rank can receive, L local experts, W ranks):
        expand_x: `[A, hidden]`, x's dtype (`torch.int8` with ``quant_mode=2``); rows past the received total are
            unspecified.
        dynamic_scales: `[A]` `torch.float32` per-row dequant scales with ``quant_mode=2``.
        expert_token_nums: `[L]` `torch.int64` rows per local expert (counts, or the inclusive cumsum with
            ``expert_token_nums_type=0``): ``npu_grouped_matmul``'s ``group_list`` (``group_list_type`` 1 / 0).
        handle: :class:`FlatHandle` for ``low_latency_combine_flat``.
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] | None = None

    def _get(self, name: str) -> Any:
        if self._values is None:
            raise RuntimeError(f"{name} is not received yet: call hook() or event.current_stream_wait() first")
        return self._values[name]

    expand_x = property(lambda self: self._get("expand_x"))
    dynamic_scales = property(lambda self: self._get("dynamic_scales"))
    expert_token_nums = property(lambda self: self._get("expert_token_nums"))
    handle = property(lambda self: self._get("handle"))


class FlatMixin:
    """``Buffer`` methods for the flat Ascend layout (see the module docstring)."""

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
    ) -> tuple[FlatDispatchOutput, EventOverlap, Callable[[], None] | None]:
        """Dispatch into the flat Ascend layout (``npu_moe_distribute_dispatch_v2`` semantics, A3 fullmesh).

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` / `torch.float16` (`torch.float32` on the reference backend), T <= N.
            topk_idx: `[T, K]` `torch.int64` / `torch.int32`: routed experts ``[0, num_experts)``, zero experts
                ``[E, E + Z)``, copy ``[E + Z, E + Z + C)``, const experts after them, or ``-1`` (no expert; mapped
                onto extra zero experts, see ``backends.base.map_no_expert``).
            num_max_dispatch_tokens_per_rank: N, the same on every rank (``global_bs = N * R``).
            num_experts: routed experts (``moe_expert_num``).
            topk_weights: `[T, K]` `torch.float32`, carried to ``handle.expand_scales`` (``expert_scales``).
            quant_mode: 0, or 2 (per-token dynamic int8: ``q = rint(x * 127 / amax)``, scale ``amax / 127``).
            smooth_scales: `[shared_expert_num + num_experts, hidden]` `torch.float32` (the op's ``scales``).
            x_active_mask: `[T]` bool (True first) or `[T, K]` bool.
            expert_token_nums_type: 1 counts, 0 inclusive cumsum.
            shared_expert_num, shared_expert_rank_num, zero/copy/const_expert_num: as in the Ascend op.
            async_finish, return_recv_hook: as in ``low_latency_dispatch``.

        Returns:
            (output, event, hook): :class:`FlatDispatchOutput`, an :class:`EventOverlap`, the receive hook or None.
        """
        self._check_alive()
        ids, zero_num = _op_ids(topk_idx, num_experts, zero_expert_num)
        num_max = num_max_dispatch_tokens_per_rank
        op_kwargs = dict(
            x_active_mask=x_active_mask,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            global_bs=num_max * self.group_size if isinstance(num_max, int) else num_max,
            zero_expert_num=zero_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num,
        )
        if self.config.ccl_buffer_size is not None:
            op_kwargs["ccl_buffer_size"] = self.config.ccl_buffer_size
        pending = self._backend.dispatch_flat(
            x,
            ids,
            moe_expert_num=num_experts,
            scales=smooth_scales,
            expert_scales=topk_weights,
            quant_mode=quant_mode,
            expert_token_nums_type=expert_token_nums_type,
            **op_kwargs,
        )
        result = FlatDispatchOutput()

        def finish() -> None:
            expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = (
                pending.teardown()
            )
            handle = FlatHandle(assist, ep_recv_counts, tp_recv_counts, expand_scales, num_experts, op_kwargs)
            result._values = dict(
                expand_x=expand_x, dynamic_scales=dynamic_scales, expert_token_nums=expert_token_nums, handle=handle
            )

        event, hook = self._overlap(Completion(finish), async_finish, return_recv_hook, ())
        return result, event, hook

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
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Combine flat expert outputs (``npu_moe_distribute_combine_v2`` semantics).

        Arguments:
            x: `[A, hidden]` expert outputs row-aligned with ``expand_x`` (`torch.bfloat16` / `torch.float16`).
            topk_idx: `[T, K]`, the one given to ``low_latency_dispatch_flat``. topk_weights: `[T, K]` fp32.
            handle: the dispatch's :class:`FlatHandle`.
            shared_expert_x: `[T, hidden]` in x's dtype, added with weight 1.
            ori_x: `[T, hidden]` (copy / const experts); const_expert_alpha_1/_2, const_expert_v:
                `[const_expert_num, hidden]`.
            comm_quant_mode: 0, or 2 (int8 on the wire).
            out: `[T, hidden]` in x's dtype, written in place, or None.

        Returns:
            combined_x: `[T, hidden]` in x's dtype (filled once the receive ran), event, hook.
        """
        self._check_alive()
        if not isinstance(handle, FlatHandle):
            raise ValueError(f"handle: must be the FlatHandle from low_latency_dispatch_flat, got {type(handle)}")
        kw = dict(handle.op_kwargs)
        k = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
        ids, _ = _op_ids(topk_idx, handle.num_experts, kw["zero_expert_num"] - k)
        pending = self._backend.combine_flat(
            x,
            ids,
            handle.assist_info_for_combine,
            handle.ep_recv_counts,
            topk_weights,
            handle.num_experts,
            expand_scales=handle.expand_scales if handle.expand_scales.numel() else None,
            shared_expert_x=shared_expert_x,
            ori_x=ori_x,
            const_expert_alpha_1=const_expert_alpha_1,
            const_expert_alpha_2=const_expert_alpha_2,
            const_expert_v=const_expert_v,
            comm_quant_mode=comm_quant_mode,
            **{k: v for k, v in kw.items() if k != "ccl_buffer_size"},
        )
        if not (async_finish or return_recv_hook):
            combined = pending.teardown()
            if out is not None:
                out.copy_(combined)
                combined = out
            return combined, EventOverlap(None), None
        combined = out if out is not None else x.new_empty((topk_idx.shape[0], x.shape[1]))

        def finish() -> None:
            combined.copy_(pending.teardown())

        event, hook = self._overlap(Completion(finish), async_finish, return_recv_hook, (combined,))
        return combined, event, hook
