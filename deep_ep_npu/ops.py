"""The Ascend MoE distribute ops with torch_npu's signatures, on the one exchange engine (:mod:`deep_ep_npu.engine`).

``moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` take exactly the arguments of
``torch_npu.npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` (the union of the A2 / A3 / Ascend 950
semantics; ``strict`` enforces one platform's), plus ``ccl_buffer_size`` and ``strict`` of our own; the ``*_start``
variants split them into send and receive phases (ours). ``moe_distribute_{dispatch,combine}_{setup,teardown}`` are
torch_npu's real two-stage ops (:mod:`deep_ep_npu.engine.staged`), with the same results as the one-shot ops.
The arguments are validated once (a rejected rank still takes part in the agreement step, so every rank raises);
the agreement step, payload all-to-all and flat placement are bounded by the group's timeout (``DEEP_EP_NPU_TIMEOUT``,
else 30 s): a peer that exits or stops calling raises :class:`~deep_ep_npu.failure.EPRankFailure` naming it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .engine import staged
from .engine.flat import start_combine_flat, start_dispatch_flat
from .errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, MoeDistributeError
from .event import Completion
from .params import CombineParams, DispatchParams
from .sizes import get_low_latency_ccl_buffer_size

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_PARAM_NULLPTR", "MoeDistributeError",
    "get_low_latency_ccl_buffer_size", "moe_distribute_combine_setup", "moe_distribute_combine_start",
    "moe_distribute_combine_teardown", "moe_distribute_combine_v2", "moe_distribute_dispatch_setup",
    "moe_distribute_dispatch_start", "moe_distribute_dispatch_teardown", "moe_distribute_dispatch_v2",
]  # fmt: skip


# fmt: off
def moe_distribute_dispatch_v2(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None, performance_info: torch.Tensor | None = None,
    group_tp: dist.ProcessGroup | str = "", tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0,
    shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0,
    expert_token_nums_type: int = 1, comm_alg: str = "", zero_expert_num: int = 0, copy_expert_num: int = 0,
    const_expert_num: int = 0, y_dtype: torch.dtype | int | None = None, x_dtype: torch.dtype | int | None = None,
    scales_dtype: torch.dtype | int | None = None, ccl_buffer_size: int | None = None, strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """Send every token to the ranks hosting its experts (Ascend MoE distribute dispatch, flat layout).

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
    return start_dispatch_flat(DispatchParams(**locals())).wait()


# fmt: off
def moe_distribute_combine_v2(
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
) -> torch.Tensor:
    # fmt: on
    """Return expert outputs to their source ranks and reduce them there (Ascend MoE distribute combine).

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
    return start_combine_flat(CombineParams(**locals())).wait()


def moe_distribute_dispatch_start(*args: object, **kwargs: object) -> Completion:
    """:func:`moe_distribute_dispatch_v2`'s send phase (same arguments): ``wait()`` on the returned
    :class:`~deep_ep_npu.event.Completion` receives and returns the 7 outputs (compute in between overlaps it)."""
    return start_dispatch_flat(DispatchParams(*args, **kwargs))  # type: ignore[arg-type]


def moe_distribute_combine_start(*args: object, **kwargs: object) -> Completion:
    """:func:`moe_distribute_combine_v2`'s send phase (same arguments): ``wait()`` on the returned
    :class:`~deep_ep_npu.event.Completion` receives, reduces and returns ``x`` (compute in between overlaps it)."""
    return start_combine_flat(CombineParams(*args, **kwargs))  # type: ignore[arg-type]


# fmt: off
def moe_distribute_dispatch_setup(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0, comm_type: int = 0, comm_alg: str = "",
    y_dtype: torch.dtype | int | None = None, strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_dispatch_setup``: the send phase of a two-stage dispatch (same arguments,
    plus ``strict``). Validation (on every rank) and the agreement step run here, and the rows leave.

    Notation: W = ep_world_size, E = moe_expert_num, L = E / W, K = top-k, S = shared_expert_num as passed,
    ``hs`` = the row size torch_npu gives ``y`` for ``quant_mode``: 0 ``Align256(H)``, 1 ``Align512(Align32(H))``,
    2 ``Align512(Align32(H) + 4)``, 3 ``Align512(Align128(H) + ceil(H / 128) * 4)``, 4 ``Align512(Align256(H) +
    Align2(ceil(H / 32)))``.

    Arguments: as :func:`moe_distribute_dispatch_v2`, with these rules of the two-stage form on every platform:
    ``comm_type`` in [0, 2] (0 AICPU-SDMA, 1 CCU, 2 URMA), ``comm_alg`` "", no shared experts
    (``shared_expert_rank_num`` 0, ``shared_expert_num`` 0 or 1), ``x_active_mask`` `[Bs]` bool only, and a quantizing
    ``quant_mode`` needs ``y_dtype``. ``strict="a5"``: also Ascend 950's ranges (W [2, 384], E (0, 512], H [1024,
    8192], Bs (0, 512], K (0, 16]), URMA only (``comm_type`` 2) and the HCCL window (``HCCL_BUFFSIZE``, default
    200 MB) of at least ``4 * (L * maxBs * W * Align512(Align32(2H) + 44) + K * maxBs * Align512(2H))`` bytes (the
    950 doc's rule); ``True`` / "a3" is refused: the op definitions register only Ascend 950.

    Returns:
        y: `[Bs * (K + S), hs]` with ``y_dtype`` (x's dtype when None): the rows as sent, pairs sorted by expert id
            (stable), row i the (quantized) copy of its token; with quant_mode 2 the fp32 scale sits at byte
            ``Align32(H)`` of the row. Rows of pairs not sent (outside ``x_active_mask``) and the tail are zero.
        expand_idx: `[Bs * K]` `torch.int32`: for pair (t, k), the number of earlier sent pairs of this rank routed to
            the same expert (its row in that expert's block); -1 for a pair not sent (ours: undefined on the NPU).
        comm_cmd_info: `[(Bs * (K + S) + W * L) * 16]` `torch.int32`: the key of this call (pass it to
            :func:`moe_distribute_dispatch_teardown`; opaque on the NPU).
    """
    return staged.dispatch_setup(staged.SetupParams(**locals()))


# fmt: off
def moe_distribute_dispatch_teardown(
    x: torch.Tensor, y: torch.Tensor, expert_ids: torch.Tensor, comm_cmd_info: torch.Tensor,
    group_ep: dist.ProcessGroup | str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0,
    global_bs: int = 0, expert_token_nums_type: int = 1, comm_type: int = 0, comm_alg: str = "",
    strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_dispatch_teardown``: wait for the rows of the dispatch_setup call that
    ``comm_cmd_info`` names (same x, y, expert_ids and keywords, else a clear error) and return them. A = ``global_bs
    * min(L, K)`` (``global_bs`` or Bs * W). No communication: its errors are local.

    Returns:
        expand_x: `[A, H]` in y's dtype (quantized rows are not dequantized): rows by local expert, then source rank,
            then the source's order, as :func:`moe_distribute_dispatch_v2`; rows past the received total are zero.
        dynamic_scales: `[A]` `torch.float32` (quant_mode 0-2; zeros for 0), `[A, ceil(H / 128)]` (3), `[A,
            Align2(ceil(H / 32))]` `torch.float8_e8m0fnu` (4): the rows' scales.
        assist_info_for_combine: `[A * 128]` `torch.int32`: ``[0 : W * L]`` the inclusive prefix sum of the rows per
            (local expert j, source rank r), j-major (the one-shot op's ``ep_recv_counts``); the rest zero.
        expert_token_nums: `[L]` `torch.int64`: rows per local expert (expert_token_nums_type 1) or their inclusive
            cumsum (0; Ascend 950 allows only 1).
    """
    return staged.dispatch_teardown(locals())


# fmt: off
def moe_distribute_combine_setup(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, assist_info_for_combine: torch.Tensor,
    group_ep: dist.ProcessGroup | str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0, global_bs: int = 0,
    comm_quant_mode: int = 0, comm_type: int = 0, comm_alg: str = "", strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_combine_setup``: send the expert outputs back. Block ``b = j * W + r`` of
    ``expand_x`` (rows ``[cum[b - 1], cum[b])``, ``cum`` = ``assist_info_for_combine[0 : W * L]``) goes to source
    rank r. Validation (on every rank) and the agreement step run here. ``comm_quant_mode`` must be 0 (the two-stage
    combine does not quantize); the other rules as :func:`moe_distribute_dispatch_setup`.

    Arguments:
        expand_x: `[A', H]` `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert outputs, row-aligned
            with dispatch_teardown's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32`: this rank's top-k ids (only its shape is used here).
        assist_info_for_combine: dispatch_teardown's output, unchanged.

    Returns:
        quant_expand_x: `[A', Align512(Align32(H) + Align8(H) / 8 * 4)]` `torch.int8`, zero (nothing is quantized).
        comm_cmd_info: `[(A' + W) * 16]` `torch.int32`: the key of this call (pass it to
            :func:`moe_distribute_combine_teardown`).
    """
    kw = {k: v for k, v in locals().items() if k != "comm_type"}
    return staged.combine_setup(staged.CombineSetupParams(ep_send_counts=None, expert_scales=None, comm_type=comm_type,
                                                          **kw))  # fmt: skip


# fmt: off
def moe_distribute_combine_teardown(
    expand_x: torch.Tensor, quant_expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor,
    expert_scales: torch.Tensor, comm_cmd_info: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, x_active_mask: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, global_bs: int = 0, comm_quant_mode: int = 0, comm_type: int = 0,
    comm_alg: str = "", strict: bool | str = False,
) -> torch.Tensor:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_combine_teardown``: wait for the rows of the combine_setup call that
    ``comm_cmd_info`` names (same expand_x, quant_expand_x and keywords) and reduce them. No communication: its
    errors are local.

    Arguments:
        expert_ids: `[Bs, K]` `torch.int32` and expand_idx `[Bs * K]` `torch.int32` (dispatch_setup's output): pair
            (t, k)'s row is row ``expand_idx[t * K + k]`` of expert ``expert_ids[t, k]``'s returned block; pairs with
            ``expand_idx`` -1 (not sent) add nothing and their ids are not checked.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights.
        x_active_mask: `[Bs]` bool prefix mask: tokens outside it are zero (the 950 kernel ignores it).
        shared_expert_x: `[Bs, H]` (or `[a, b, H]`, a * b = Bs) in expand_x's dtype, added with weight 1 (the
            documented formula; the 950 kernel ignores it).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k expert_scales[t, k] * row(t, k)`` over slots ascending in fp32, plus
        ``shared_expert_x[t]``, one round-to-nearest-even cast; exactly :func:`moe_distribute_combine_v2`'s result.
    """
    return staged.combine_teardown(locals())
