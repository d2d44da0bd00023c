"""The Ascend MoE distribute ops with torch_npu's signatures, on the one engine (:mod:`deep_ep_npu.engine`).

``moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` take exactly the arguments of
``torch_npu.npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` (the union of the A2 / A3 / Ascend 950
semantics; ``strict`` enforces one platform's), plus ``ccl_buffer_size`` and ``strict`` of our own; the ``*_start``
variants split them into send and receive phases (ours). ``moe_distribute_{dispatch,combine}_{setup,teardown}`` are
torch_npu's real two-stage ops (:mod:`.two_stage`), with the same results as the one-shot ops. The arguments are
validated once by the core's rules (:mod:`deep_ep_npu.core.ascend`; a rejected rank still takes part in the agreement
step, so every rank raises); every collective is bounded by the group's timeout (``DEEP_EP_NPU_TIMEOUT``, else 30 s):
a peer that exits or stops calling raises :class:`~deep_ep_npu.EPRankFailure` naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
import torch.distributed as dist

from ..core import ascend, rules
from ..core.call import CombineCall, DispatchCall
from ..engine.exchange import InFlight, engine_for
from ..errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, MoeDistributeError
from ..sizes import get_low_latency_ccl_buffer_size
from ..transports.collective import EPGroup
from ..transports.names import resolve_group
from .two_stage import (
    moe_distribute_combine_setup,
    moe_distribute_combine_teardown,
    moe_distribute_dispatch_setup,
    moe_distribute_dispatch_teardown,
)

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_PARAM_NULLPTR", "MoeDistributeError",
    "get_low_latency_ccl_buffer_size", "moe_distribute_combine_setup", "moe_distribute_combine_start",
    "moe_distribute_combine_teardown", "moe_distribute_combine_v2", "moe_distribute_dispatch_setup",
    "moe_distribute_dispatch_start", "moe_distribute_dispatch_teardown", "moe_distribute_dispatch_v2",
]  # fmt: skip
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


# fmt: off
def moe_distribute_dispatch_start(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None, performance_info: torch.Tensor | None = None,
    group_tp: dist.ProcessGroup | str = "", tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0,
    shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0,
    expert_token_nums_type: int = 1, comm_alg: str = "", zero_expert_num: int = 0, copy_expert_num: int = 0,
    const_expert_num: int = 0, y_dtype: torch.dtype | int | None = None, x_dtype: torch.dtype | int | None = None,
    scales_dtype: torch.dtype | int | None = None, ccl_buffer_size: int | None = None, strict: bool | str = False,
) -> InFlight:
    # fmt: on
    """Send every token to the ranks hosting its experts (Ascend MoE distribute dispatch, flat layout): the send
    phase; ``wait()`` on the returned :class:`~deep_ep_npu.engine.exchange.InFlight` receives and returns the outputs
    below (compute in between overlaps it). :func:`moe_distribute_dispatch_v2` is both in one call.

    Notation: W = ep_world_size, SR = shared_expert_rank_num, S = shared experts (0 when SR == 0: the tiling turns
    the default shared_expert_num=1 into 0), L = routed experts per MoE rank (moe_expert_num / (W - SR)), K = top-k,
    ``global_bs_real = global_bs or Bs * W``, A = rows this rank can receive per TP rank: ``global_bs_real * min(L, K)``
    on a MoE rank, ``global_bs_real / W * ceil(W / R)`` (R = SR / S) on a shared-expert rank, the larger of both with
    elastic_info. Ranks ``[0, SR)`` host shared expert ``s`` on ranks ``s * R .. s * R + R - 1``; routed expert e lives
    on rank ``SR + e // L``, local slot ``e % L``.

    Arguments:
        x: `[Bs, H]` with `torch.bfloat16` / `torch.float16` (`torch.float32` on this reference path); Bs in [0, 512].
        expert_ids: `[Bs, K]` with `torch.int32` (`torch.int64` accepted), K in (0, 16], ids distinct per row,
            in [0, moe_expert_num + zero_expert_num + copy_expert_num + const_expert_num). Zero / copy / const
            experts (ids from moe_expert_num on, in that order) are never sent; combine handles them locally.
        group_ep: the EP `ProcessGroup` or its group name; ep_world_size / ep_rank_id must match it.
        moe_expert_num: routed experts in total, divisible by W - SR.
        scales: `[S + moe_expert_num, H]` `torch.float32` smooth scales for quant_mode 2, shared experts first
            (row ``s``: shared expert s, row ``S + e``: routed expert e).
        x_active_mask: `[Bs]` bool (True entries first: the active prefix) or `[Bs, K]` bool per pair. Excluded
            rows / pairs are neither validated nor sent: their ids (and weights, and 1D-excluded rows of x) may hold
            anything, e.g. ``torch.empty`` padding. A token goes to the shared experts if it is in the prefix (1D) or
            has any active pair (2D, an assumption: undocumented).
        expert_scales: `[Bs, K]` `torch.float32` top-k weights, carried to ``expand_scales`` (shared rows carry 1).
        elastic_info: `[4 + 2W]` `torch.int32` ``[is_scaled_down, new_rank_count W', new_shared_rank_count SR',
            new_moe_expert_count E', Table1[W] (EP rank -> new rank or -1), Table2[W] (new rank -> EP rank)]``:
            experts are laid out over the W' new ranks as above; ranks mapped to -1 send and receive nothing (they
            must still call the op). Only with tp_world_size <= 1.
        performance_info: `[W]` `torch.int64`; each call adds this rank's wait in µs (header exchange + payload
            wait, one collective for all sources) to the entry of every source rank that sent it data. Never reset.
        group_tp, tp_world_size, tp_rank_id: TP domain. With tp_world_size 2 (group_tp: a 2-rank `ProcessGroup` or
            its name, L must be 1), each rank also receives its TP peer's rows: own rows first, then the peer's.
        expert_shard_type: 0 (shared experts on the first ranks); shared_expert_num in [0, 4].
        quant_mode: 0 none; 2 per-token dynamic: ``s = maxV / amax``, ``q = rint(xf * s)`` clamped to ``+-maxV``,
            scale ``amax / maxV`` (maxV 127 int8, 448 float8_e4m3fn, 57344 float8_e5m2; ``xf = x * scales[row]`` when
            ``scales`` is given); 3 (Ascend 950) per 128 channels, float8: ``scale_g = amax_g / maxV``,
            ``q = cast(xf / scale_g)``; 4 (Ascend 950) MX per 32 elements, float8, no ``scales``: e8m0 code
            ``c = max(floor(log2 amax) + 127 - emax, 0)`` (emax 8 e4m3 / 15 e5m2; 0 for a zero block, 0xFF with
            Inf / NaN), ``q = cast(clamp(x / 2^(c - 127), +-maxV))``. For float8 targets ``rint`` is the cast (nearest,
            ties to even), saturating at maxV. 1 (static) is refused: its rounding is undocumented.
        global_bs: 0 (every rank has the same Bs) or max(Bs) * W.
        expert_token_nums_type: 1 counts, 0 inclusive cumsum.
        comm_alg: "", "fullmesh" (Atlas A2), "fullmesh_v1", "fullmesh_v2" (K <= 12; Bs <= 256 on Atlas A3),
            "hierarchy" (Atlas A3) or "ccu" (in no v2 doc; sgl-kernel-npu passes it): one layout and result here,
            fullmesh's. "hierarchy" needs ``expert_scales`` and allows no TP (tp_world_size <= 1), shared-expert
            ranks, zero / copy / const experts, 2D x_active_mask or performance_info; with strict "a3" also Bs <= 256,
            H <= 7168 and a multiple of 32, W in [16, 256] a multiple of 16, L <= 24, L * W <= 512. Its intra-server
            pre-sum is the NPU's fp32 transport optimization: combine results are fullmesh's.
        y_dtype, x_dtype, scales_dtype: (Ascend 950) a `torch.dtype` or a torch_npu dtype code (ScalarType code, or
            the ACL enum + 256, e.g. ``torch_npu.float8_e4m3fn`` = 292). y_dtype is expand_x's dtype: None (x's dtype;
            `torch.int8` with quant_mode 2); `torch.int8` / `torch.float8_e4m3fn` / `torch.float8_e5m2` with
            quant_mode 2; one of the two float8 types (required) with 3 / 4. fp4 and hifloat8 are refused. x_dtype:
            None or x's own dtype; scales_dtype: None or `torch.float32` (relabelling storage is not implemented).
        ccl_buffer_size: MB of CCL window available (None: unchecked); too small raises naming the size needed (the
            ops-transformer formula; for "fullmesh", "hierarchy" and "ccu", which it does not cover, fullmesh_v1's).
        strict: False (what any platform accepts), True / "a3" (Atlas A3: H in [1024, 8192], W in [2, 768],
            bf16/fp16, int32 ids, comm_alg "", fullmesh_v1, fullmesh_v2, hierarchy; Ascend 950 features refused) or
            "a5" (Ascend 950: H in [1024, 8192], W in [2, 1024], Bs <= 512, comm_alg "", fullmesh_v1, fullmesh_v2,
            tp_world_size <= 1, no elastic_info; Atlas A3 features refused). Errors name the platform a feature
            belongs to.

    Returns:
        expand_x: `[A * max(tp_world_size, 1), H]`, x's dtype, or the quantized dtype (y_dtype; `torch.int8` by default
            with quant_mode 2), not dequantized. Rows expert-major, then source rank, then source token; with TP the
            peer's rows follow this rank's. Rows past the received total are zero (uninitialized on the NPU).
        dynamic_scales: per-row dequant scales: quant_mode 2 `[A * max(tp, 1)]` `torch.float32`; 3
            `[A, ceil(H / 128)]` `torch.float32`; 4 `[A, align2(ceil(H / 32))]` `torch.float8_e8m0fnu` (the padding
            entry is code 0); quant_mode 0 `[A * max(tp, 1)]` zeros (`[A * max(tp, 1), H]` when ``scales`` is given).
        assist_info_for_combine: `[max(Bs * K, A * 128)]` `torch.int32`; own row i holds (src EP rank, src token,
            top-k slot; ``K + s`` for shared expert s) at ``[3i : 3i + 3]``, the rest is zero.
        expert_token_nums: `[L]` `torch.int64` rows per local expert, TP peer's rows included (cumsum when
            expert_token_nums_type = 0). `[1]` on a shared-expert rank.
        ep_recv_counts: `[W * L * max(tp, 1)]` `torch.int32` inclusive cumsum over (local expert, source rank); with TP
            the peer's W * L entries follow and continue the sum, so they index expand_x directly (plus
            ``2 * global_bs * K * (W // 8)`` zero entries when expert_scales is given, except with strict "a5", as on
            the NPU).
        tp_recv_counts: `[tp_world_size]` `torch.int32`: rows from each TP rank (the row count with tp_world_size 1).
        expand_scales: `[A]` `torch.float32` weight of each own row when expert_scales is given, else `[0]`.

    Raises:
        MoeDistributeError: invalid input, on every rank of the EP domain and TP pair (codes 161001 / 161002 / 561002).
    """

    pg = group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep")
    engine = engine_for(pg)
    try:
        experts = ascend.experts(
            pg, ep_world_size, ep_rank_id, moe_expert_num, strict=strict, expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
            zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num,
            comm_alg=comm_alg, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, tp=lambda: tp_group(group_tp),
            elastic_info=elastic_info,
        )
        call = rules.dispatch(DispatchCall(
            DISPATCH, "flat", x, expert_ids, experts, global_bs=global_bs, x_active_mask=x_active_mask,
            expert_scales=expert_scales, quant=(quant_mode, y_dtype, x_dtype, scales_dtype), scales=scales,
            wait_stats=performance_info, expert_token_nums_type=expert_token_nums_type,
            ccl_buffer_size=ccl_buffer_size, comm_alg=comm_alg,
        ))  # fmt: skip
    except MoeDistributeError as err:
        engine.reject(DISPATCH, err.code, _tp_or_none(group_tp, tp_world_size))
        raise
    return engine.dispatch(call)


# fmt: off
def moe_distribute_combine_start(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None, elastic_info: torch.Tensor | None = None,
    ori_x: torch.Tensor | None = None, const_expert_alpha_1: torch.Tensor | None = None,
    const_expert_alpha_2: torch.Tensor | None = None, const_expert_v: torch.Tensor | None = None,
    performance_info: torch.Tensor | None = None, group_tp: dist.ProcessGroup | str = "", tp_world_size: int = 0,
    tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0,
    global_bs: int = 0, comm_quant_mode: int = 0, comm_alg: str = "", zero_expert_num: int = 0,
    copy_expert_num: int = 0, const_expert_num: int = 0, strict: bool | str = False,
) -> InFlight:
    # fmt: on
    """Return expert outputs to their source ranks and reduce them there (Ascend MoE distribute combine): the send
    phase; ``wait()`` on the returned :class:`~deep_ep_npu.engine.exchange.InFlight` receives, reduces and returns
    ``x`` below. :func:`moe_distribute_combine_v2` is both in one call.

    Same notation as :func:`moe_distribute_dispatch_v2`. With tp_world_size 2 a ReduceScatterV over the TP pair runs
    first (each rank's own rows + the peer's partial result for them, fp32 add, one cast), then the AllToAllV over EP.

    Arguments:
        expand_x: `[A * max(tp, 1), H]` with `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert
            outputs, row-aligned with dispatch's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32`, x_active_mask `[Bs]` / `[Bs, K]` bool (ids and weights of excluded
            pairs are never read), global_bs, the layout keywords (shared experts, zero/copy/const counts,
            elastic_info, TP, comm_alg): as given to dispatch.
        assist_info_for_combine: dispatch's `torch.int32` output, unchanged.
        ep_send_counts: dispatch's ``ep_recv_counts`` (`[W * L * max(tp, 1)]` `torch.int32`), unchanged.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights, applied at the source rank; an empty tensor (Ascend
            950) means weight 1 (a plain sum).
        tp_send_counts: dispatch's ``tp_recv_counts`` (`[2]` `torch.int32`); required with tp_world_size 2.
        shared_expert_x: `[Bs, H]` (or `[a, b, H]` with a * b = Bs), expand_x's dtype: added with weight 1. Only
            when shared_expert_rank_num is 0.
        ori_x: `[Bs, H]`, expand_x's dtype: the tokens before dispatch; required iff copy or const experts exist.
        const_expert_alpha_1, const_expert_alpha_2, const_expert_v: `[const_expert_num, H]`, expand_x's dtype;
            required iff const_expert_num > 0.
        performance_info: `[W]` `torch.int64`, accumulated as in dispatch (µs per source rank; never reset).
        comm_quant_mode: 0; 2: rows travel as int8 with one scale per 8 elements kept in expand_x's dtype (``scale =
            to_dtype(amax / 127)``, ``q = rint(y / scale)``, received as ``to_dtype(q * scale)``; H a multiple of 8);
            each value within half a step (``amax_8 / 254``); 3 / 4 (Ascend 950): MX float8 e5m2 / e4m3 with one e8m0
            scale per 32 elements (dispatch quant_mode 4's codec), received as ``to_dtype(q * 2^(c - 127))``: each
            value within ``2^(floor(log2 amax_32) - 2)`` (<= amax_32 / 4, the saturation of scaled values in
            (maxV, 2^(emax + 1)) to maxV; other elements within half a float8 step). Plus the output dtype's
            rounding; not with tp_world_size 2.
        comm_alg: as dispatch (same result); strict "a3" allows "" and "hierarchy", "a5" only "".
        strict: as dispatch.
        expand_scales: accepted for signature compatibility; unused (A3 fullmesh weights at the source).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k c[t, k]`` over slots k ascending in fp32, where c is
        ``expert_scales[t, k] * y[t, k]`` for a routed expert, 0 for a zero expert, ``w * ori_x[t]`` for a copy
        expert and ``w * (a1 * ori_x[t] + a2 * v[c])`` for const expert c, with
        ``(a1, a2) = softmax(<alpha_1[c], ori_x[t]>, <alpha_2[c], ori_x[t]>)`` (the kernel's reading; the docs'
        formula reads as elementwise); then each shared expert's output (slot ``K + s``) and ``shared_expert_x[t]``
        with weight 1; one round-to-nearest-even cast. Masked pairs contribute nothing; tokens outside a 1D mask's
        prefix are zero, and so is every token of a rank that elastic_info scaled out.

    Raises:
        MoeDistributeError: invalid input, or inputs that do not match the dispatch (on every rank).
    """

    pg = group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep")
    engine = engine_for(pg)
    try:
        experts = ascend.experts(
            pg, ep_world_size, ep_rank_id, moe_expert_num, strict=strict, expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
            zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num,
            comm_alg=comm_alg, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, tp=lambda: tp_group(group_tp),
            elastic_info=elastic_info,
            combine=True,
        )
        call = rules.combine(CombineCall(
            COMBINE, "flat", expand_x, expert_ids, experts, (assist_info_for_combine, ep_send_counts, tp_send_counts),
            x_active_mask=x_active_mask, expert_scales=expert_scales, shared_expert_x=shared_expert_x, ori_x=ori_x,
            const_expert_alpha_1=const_expert_alpha_1, const_expert_alpha_2=const_expert_alpha_2,
            const_expert_v=const_expert_v, comm_quant_mode=comm_quant_mode, wait_stats=performance_info,
            global_bs=global_bs, comm_alg=comm_alg,
        ))  # fmt: skip
    except MoeDistributeError as err:
        engine.reject(COMBINE, err.code, _tp_or_none(group_tp, tp_world_size))
        raise
    return engine.combine(call)


def one_shot(start: Callable[_P, InFlight], name: str, what: str) -> Callable[_P, Any]:
    """The one-shot op of a split one: ``start(...)`` and its wait, with ``start``'s signature."""

    @functools.wraps(start)
    def op(*args: _P.args, **kwargs: _P.kwargs) -> Any:
        return start(*args, **kwargs).wait()

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"""{what}: :func:`{start.__name__}` and its ``wait()`` (see there for the arguments and outputs)."""
    return op


moe_distribute_dispatch_v2 = one_shot(moe_distribute_dispatch_start, DISPATCH,
                                      "torch_npu's ``npu_moe_distribute_dispatch_v2``: returns its 7 outputs")
moe_distribute_combine_v2 = one_shot(moe_distribute_combine_start, COMBINE,
                                     "torch_npu's ``npu_moe_distribute_combine_v2``: returns ``x`` `[Bs, H]`")
