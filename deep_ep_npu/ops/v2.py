"""torch_npu's ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` on the one engine, and their
split form (ours): ``moe_distribute_{dispatch,combine}_start`` run the send phase and return the
:class:`~deep_ep_npu.backends.InFlight` whose ``wait()`` receives (see :mod:`deep_ep_npu.ops`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
import torch.distributed as dist

from ..backends import InFlight
from ..core import ascend
from ..core.call import FlatCombine, FlatDispatch
from ..engine import flat, static_flat
from ..engine.exchange import engine_for
from ..errors import MoeDistributeError
from ..transports.group import EPGroup
from ..transports.names import resolve_group

DISPATCH, COMBINE = "moe_distribute_dispatch_v2", "moe_distribute_combine_v2"
_P = ParamSpec("_P")


def tp_group(group_tp: object) -> EPGroup:
    """The bounded group of the TP pair ``group_tp`` (a ProcessGroup or its name)."""
    return engine_for(group_tp if isinstance(group_tp, dist.ProcessGroup) else resolve_group(group_tp, "group_tp")).ep


def _tp_or_none(group_tp: object, tp_world_size: object) -> EPGroup | None:
    """The TP pair's group to tell about a rejection, when it names one."""
    try:
        return tp_group(group_tp) if tp_world_size == 2 else None
    except MoeDistributeError:
        return None


def moe_distribute_dispatch_start(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    group_tp: dist.ProcessGroup | str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    y_dtype: torch.dtype | int | None = None,
    x_dtype: torch.dtype | int | None = None,
    scales_dtype: torch.dtype | int | None = None,
    ccl_buffer_size: int | None = None,
    strict: bool | str = False,
) -> InFlight:
    """The send phase of :func:`moe_distribute_dispatch_v2` (torch_npu's ``npu_moe_distribute_dispatch_v2``, flat
    layout): each token goes to the ranks hosting its experts; ``wait()`` on the returned
    :class:`~deep_ep_npu.backends.InFlight` receives and returns the outputs below.

    Notation: W = ep_world_size, SR = shared_expert_rank_num, S = shared experts (0 when SR == 0: the tiling turns
    the default shared_expert_num=1 into 0), L = routed experts per MoE rank (moe_expert_num / (W - SR)), K = top-k,
    ``global_bs_real = global_bs or Bs * W``, A = rows this rank can receive per TP rank: ``global_bs_real * min(L, K)``
    on a MoE rank, ``global_bs_real / W * ceil(W / R)`` (R = SR / S) on a shared-expert rank, the larger of both with
    elastic_info. Ranks ``[0, SR)`` host shared expert ``s`` on ranks ``s * R .. s * R + R - 1``; routed expert e lives
    on rank ``SR + e // L``, local slot ``e % L``.

    Arguments:
        x: `[Bs, H]` `torch.bfloat16` / `torch.float16` (`torch.float32` here), Bs in [0, 512].
        expert_ids: `[Bs, K]` `torch.int32` (`torch.int64` accepted), K in (0, 16], ids distinct per row, in
            [0, moe_expert_num + zero_expert_num + copy_expert_num + const_expert_num); zero / copy / const experts
            (ids from moe_expert_num on, in that order) are never sent: combine handles them locally.
        group_ep: the EP `ProcessGroup` or its group name (ep_world_size / ep_rank_id must match it).
        moe_expert_num: routed experts in total, divisible by W - SR.
        scales: `[S + moe_expert_num, H]` `torch.float32` smooth scales (row ``s``: shared expert s, ``S + e``:
            routed expert e); without shared-expert ranks also `[shared_expert_num + moe_expert_num, H]` (S as
            passed, as torch_npu's tests give it: the leading rows are unused).
        x_active_mask: `[Bs]` bool (the active prefix) or `[Bs, K]` bool per pair; excluded rows / pairs are neither
            validated nor sent. A token goes to the shared experts if it is active (2D: has an active pair).
        expert_scales: `[Bs, K]` `torch.float32` top-k weights, carried to ``expand_scales`` (shared rows carry 1).
        elastic_info: `[4 + 2W]` `torch.int32` ``[is_scaled_down, new_rank_count W', new_shared_rank_count SR',
            new_moe_expert_count E', Table1[W] (EP rank -> new rank or -1), Table2[W] (new rank -> EP rank)]``:
            the experts laid out over the W' new ranks; ranks mapped to -1 still call the op. Only with TP <= 1.
        performance_info: `[W]` `torch.int64`; each call adds this rank's wait in µs to the entry of every source
            rank that sent it data. Never reset.
        group_tp, tp_world_size, tp_rank_id: with tp_world_size 2 (group_tp: a 2-rank `ProcessGroup` or its name,
            L must be 1) each rank also receives its TP peer's rows, after its own.
        expert_shard_type: 0 (shared experts on the first ranks); shared_expert_num in [0, 4].
        quant_mode: 0 none; 2 per token (:func:`~deep_ep_npu.quant.per_token`, ``xf = x * scales[row]`` with
            ``scales``); 3 (Ascend 950) float8 per 128 channels (:func:`~deep_ep_npu.quant.per_group_fp8`); 4 (Ascend
            950) MX float8 per 32 elements, no ``scales`` (:func:`~deep_ep_npu.quant.mx_fp8`); 5 (Ascend 950) MX_CLIP,
            as 4 with the scale rounded up so no element saturates (:func:`~deep_ep_npu.quant.mx_clip_fp8`). 1
            (static) is refused: its rounding is undocumented.
        global_bs: 0 (every rank has the same Bs) or max(Bs) * W. expert_token_nums_type: 1 counts, 0 their cumsum.
        comm_alg: "", "fullmesh" (Atlas A2), "fullmesh_v1", "fullmesh_v2" (K <= 12), "hierarchy" (Atlas A3) or "ccu"
            (in no v2 doc; sgl-kernel-npu passes it): all give fullmesh's layout and results here. "hierarchy" needs
            ``expert_scales`` and allows no TP, shared-expert ranks, zero / copy / const experts, 2D x_active_mask or
            performance_info (strict "a3" adds its size limits).
        y_dtype, x_dtype, scales_dtype: (Ascend 950) a `torch.dtype` or a torch_npu dtype code (e.g.
            ``torch_npu.float8_e4m3fn`` = 292). y_dtype, expand_x's: None (x's; `torch.int8` with quant_mode 2),
            `torch.int8` / `torch.float8_e4m3fn` / `torch.float8_e5m2` with quant_mode 2, a float8 one (required)
            with 3 / 4 / 5. x_dtype: None or x's dtype; scales_dtype: None or `torch.float32`.
        ccl_buffer_size: MB of CCL window available (None: unchecked); too small raises naming the size needed (the
            ops-transformer formula; fullmesh_v1's for "fullmesh", "hierarchy" and "ccu", which it does not cover).
        strict: False (what any platform accepts), True / "a3" (Atlas A3's limits: H in [1024, 8192], W in
            [2, 768], bf16 / fp16, int32 ids) or "a5" (Ascend 950's: H in [1024, 8192], W in [2, 1024]); the other
            platforms' features are refused, naming the platform they belong to.

    Returns:
        expand_x: `[A * max(tp_world_size, 1), H]` in y_dtype (not dequantized): rows by local expert, then source
            rank, then source token, the TP peer's after this rank's; zero past the received total.
        dynamic_scales: per-row dequant scales: quant_mode 2 `[A * max(tp, 1)]` `torch.float32`; 3
            `[A, ceil(H / 128)]` `torch.float32`; 4 / 5 `[A, align2(ceil(H / 32))]` `torch.float8_e8m0fnu` (the padding
            entry is code 0); quant_mode 0 `[A * max(tp, 1)]` zeros (`[A * max(tp, 1), H]` when ``scales`` is given).
        assist_info_for_combine: `[max(Bs * K, A * 128)]` `torch.int32`; own row i holds (src EP rank, src token,
            top-k slot; ``K + s`` for shared expert s) at ``[3i : 3i + 3]``, the rest is zero.
        expert_token_nums: `[L]` `torch.int64` rows per local expert, TP peer's rows included (cumsum when
            expert_token_nums_type = 0). `[1]` on a shared-expert rank.
        ep_recv_counts: `[W * L * max(tp, 1)]` `torch.int32` inclusive cumsum over (local expert, source rank), the
            TP peer's continuing it (plus ``2 * global_bs * K * (W // 8)`` zeros when expert_scales is given, except
            with strict "a5", as on the NPU).
        tp_recv_counts: `[tp_world_size]` `torch.int32`: rows from each TP rank (the row count with tp_world_size 1).
        expand_scales: `[A]` `torch.float32` weight of each own row when expert_scales is given, else `[0]`.

    Raises:
        MoeDistributeError: invalid input, on every rank of the EP domain and TP pair.
    """
    engine = engine_for(group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep"))
    with engine.rejecting(DISPATCH, tp=_tp_or_none(group_tp, tp_world_size)):
        experts = ascend.experts(
            engine.group,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            strict=strict,
            expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num,
            comm_alg=comm_alg,
            tp_world_size=tp_world_size,
            tp_rank_id=tp_rank_id,
            tp=lambda: tp_group(group_tp),
            elastic_info=elastic_info,
        )
        call = ascend.dispatch(
            FlatDispatch(
                DISPATCH,
                x,
                expert_ids,
                experts,
                global_bs=global_bs,
                x_active_mask=x_active_mask,
                expert_scales=expert_scales,
                quant=ascend.quant(quant_mode, y_dtype, x_dtype, scales_dtype, x, experts.platform),
                scales=scales,
                wait_stats=performance_info,
                expert_token_nums_type=expert_token_nums_type,
                ccl_buffer_size=ccl_buffer_size,
                comm_alg=comm_alg,
            )
        )
    return static_flat.dispatch(engine, call) if flat.static_round(engine, call) else engine.dispatch(call)


def moe_distribute_combine_start(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    ori_x: torch.Tensor | None = None,
    const_expert_alpha_1: torch.Tensor | None = None,
    const_expert_alpha_2: torch.Tensor | None = None,
    const_expert_v: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None,
    group_tp: dist.ProcessGroup | str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    strict: bool | str = False,
) -> InFlight:
    """The send phase of :func:`moe_distribute_combine_v2` (torch_npu's ``npu_moe_distribute_combine_v2``): expert
    outputs go back to their source ranks; ``wait()`` on the returned :class:`~deep_ep_npu.backends.InFlight`
    receives, reduces and returns ``x`` below. With tp_world_size 2 a ReduceScatterV over the TP pair runs first
    (each rank's own rows + the peer's partial result for them, fp32 add, one cast), then the AllToAllV over EP.

    Arguments (notation as :func:`moe_distribute_dispatch_start`):
        expand_x: `[A * max(tp, 1), H]` `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert outputs,
            row-aligned with dispatch's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32`, x_active_mask `[Bs]` / `[Bs, K]` bool (ids and weights of excluded
            pairs are never read), global_bs, the layout keywords (shared experts, zero / copy / const counts,
            elastic_info, TP, comm_alg; strict "a3" allows comm_alg "" and "hierarchy", "a5" only ""), strict,
            performance_info: as given to dispatch.
        assist_info_for_combine, ep_send_counts (dispatch's ``ep_recv_counts``), tp_send_counts (its
            ``tp_recv_counts``, required with tp_world_size 2): dispatch's `torch.int32` outputs, unchanged.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights, applied at the source rank; an empty tensor means
            weight 1, a plain sum (every platform, Atlas A3 included).
        shared_expert_x: `[Bs, H]` (or `[a, b, H]` with a * b = Bs), expand_x's dtype: added with weight 1. Only
            when shared_expert_rank_num is 0.
        ori_x: `[Bs, H]`, expand_x's dtype: the tokens before dispatch; required iff copy or const experts exist.
        const_expert_alpha_1, const_expert_alpha_2, const_expert_v: `[const_expert_num, H]`, expand_x's dtype;
            required iff const_expert_num > 0.
        comm_quant_mode: 0; 2: rows travel as int8 per 8 elements (H a multiple of 8,
            :func:`~deep_ep_npu.quant.per_group_int8`); 3 / 4 (Ascend 950): MX float8 e5m2 / e4m3 per 32 elements
            (:func:`~deep_ep_npu.quant.mx_fp8`). Not with tp_world_size 2.
        expand_scales: accepted for signature compatibility; unused (A3 fullmesh weights at the source).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k c[t, k]`` over slots ascending in fp32, ``c`` being
        ``expert_scales[t, k] * y[t, k]`` (routed expert), 0 (zero expert), ``w * ori_x[t]`` (copy expert) or
        ``w * (a1 * ori_x[t] + a2 * v[c])`` (const expert c, ``(a1, a2) = softmax(<alpha_1[c], ori_x[t]>,
        <alpha_2[c], ori_x[t]>)``: the kernel's reading); then each shared expert's output and ``shared_expert_x[t]``
        with weight 1; one round-to-nearest-even cast. Masked pairs add nothing; tokens outside a 1D mask and every
        token of a rank that elastic_info scaled out are zero.

    Raises:
        MoeDistributeError: invalid input, or inputs that do not match the dispatch (on every rank).
    """
    engine = engine_for(group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep"))
    with engine.rejecting(COMBINE, tp=_tp_or_none(group_tp, tp_world_size)):
        experts = ascend.experts(
            engine.group,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            strict=strict,
            expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num,
            comm_alg=comm_alg,
            tp_world_size=tp_world_size,
            tp_rank_id=tp_rank_id,
            tp=lambda: tp_group(group_tp),
            elastic_info=elastic_info,
            combine=True,
        )
        call = ascend.combine(
            FlatCombine(
                COMBINE,
                expand_x,
                expert_ids,
                experts,
                (assist_info_for_combine, ep_send_counts, tp_send_counts),
                x_active_mask=x_active_mask,
                expert_scales=expert_scales,
                shared_expert_x=shared_expert_x,
                ori_x=ori_x,
                const_expert_alpha_1=const_expert_alpha_1,
                const_expert_alpha_2=const_expert_alpha_2,
                const_expert_v=const_expert_v,
                comm_quant_mode=comm_quant_mode,
                wait_stats=performance_info,
                global_bs=global_bs,
                comm_alg=comm_alg,
            )
        )
    return static_flat.combine(engine, call) if flat.static_round(engine, call) else engine.combine(call)


def one_shot(start: Callable[_P, InFlight], name: str) -> Callable[_P, Any]:
    """The one-shot op of a split one: ``start(...)`` and its wait, with ``start``'s signature."""

    @functools.wraps(start)
    def op(*args: _P.args, **kwargs: _P.kwargs) -> Any:
        return start(*args, **kwargs).wait()

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"""torch_npu's ``npu_{name}``: :func:`{start.__name__}` and its ``wait()`` (see there for the
    arguments and outputs)."""
    return op


moe_distribute_dispatch_v2 = one_shot(moe_distribute_dispatch_start, DISPATCH)
moe_distribute_combine_v2 = one_shot(moe_distribute_combine_start, COMBINE)
