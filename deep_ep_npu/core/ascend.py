"""The rules of the Ascend MoE distribute ops (``_v2``, two-stage, the Buffer's flat methods, MegaMoE's pipeline):
:func:`experts`, :func:`tokens`, then the flat layout's :func:`dispatch` and :func:`combine` (sources: the aclnn
``MoeDistributeDispatchV4`` / ``CombineV4`` docs). Without ``strict`` they accept the union of the platforms;
``strict="a3"`` (or True) / ``"a5"`` add that platform's limits and refuse the other's features, naming the platform."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..errors import invalid, null, shape
from ..quant import Quant
from ..sizes import ccl_buffer_bytes, ccl_buffer_mb
from . import rules as checks
from .call import Experts, FlatCombine, FlatDispatch
from .platforms import dispatch_quant, hierarchy_rules
from .rules import PLATFORM_NAMES, platform_feature

NPU_ACT_DTYPES = (torch.bfloat16, torch.float16)
MAX_BS = 512
PLATFORMS = {False: None, True: "a3", "a3": "a3", "a5": "a5"}
OP_COMM_ALGS = ("", "fullmesh", "fullmesh_v1", "fullmesh_v2", "hierarchy", "ccu")  # one layout here: fullmesh's
COMM_ALG_PLATFORMS = {  # (dispatch, combine): the platforms whose docs list each comm_alg
    "": (("a3", "a5"), ("a3", "a5")), "fullmesh": (("a2",), ("a2",)), "fullmesh_v1": (("a3", "a5"), ()),
    "fullmesh_v2": (("a3", "a5"), ()), "hierarchy": (("a3",), ("a3",)), "ccu": ((), ()),
}  # fmt: skip
MAX_WORLD = {None: 1 << 16, "a3": 768, "a5": 1024}


def platform(strict: object) -> str | None:
    """``strict`` as ``None`` (no platform limits), ``"a3"`` or ``"a5"``; anything else is a clear error."""
    if isinstance(strict, (bool, str)) and strict in PLATFORMS:
        return PLATFORMS[strict]
    raise invalid("strict", f"got {strict!r}; allowed False, True (= 'a3'), 'a3' (Atlas A3) or 'a5' (Ascend 950)")


def experts(
    pg: dist.ProcessGroup,
    ep_world_size: object,
    ep_rank_id: object,
    moe_expert_num: object,
    *,
    strict: object = False,
    expert_shard_type: object = 0,
    shared_expert_num: object = 1,
    shared_expert_rank_num: object = 0,
    zero_expert_num: object = 0,
    copy_expert_num: object = 0,
    const_expert_num: object = 0,
    comm_alg: object = "",
    tp_world_size: object = 0,
    tp_rank_id: object = 0,
    tp: object = None,
    elastic_info: object = None,
    combine: bool = False,
) -> Experts:
    """The experts of an op call on group ``pg`` (``tp()``: the TP pair's EPGroup, resolved once the TP keywords
    passed): every expert keyword checked (no communication)."""
    plat = platform(strict)
    w = checks.in_range(ep_world_size, "ep_world_size", 2 if plat else 1, MAX_WORLD[plat])
    if w != dist.get_world_size(pg):
        raise shape("ep_world_size", f"is {w} but group_ep has {dist.get_world_size(pg)} ranks")
    rank = checks.in_range(ep_rank_id, "ep_rank_id", 0, w - 1)
    if rank != dist.get_rank(pg):
        raise shape("ep_rank_id", f"is {rank} but this process is rank {dist.get_rank(pg)} of group_ep")
    e = checks.in_range(moe_expert_num, "moe_expert_num", 1, 1024 if plat else 1 << 20)
    checks.in_range(expert_shard_type, "expert_shard_type", 0, 0, code="param")
    s = checks.in_range(shared_expert_num, "shared_expert_num", 0, 4, code="param")
    sr = checks.in_range(shared_expert_rank_num, "shared_expert_rank_num", 0, w - 1)
    effective = _effective_shared(s, sr, w)
    num_local = e // (moe_ranks := w - sr)
    if e % moe_ranks:
        why = f"{e} is not divisible by the {moe_ranks} MoE ranks (ep_world_size - shared_expert_rank_num)"
        raise shape("moe_expert_num", why)
    special = zip(("zero", "copy", "const"), (zero_expert_num, copy_expert_num, const_expert_num), strict=True)
    zero, copy, const = (checks.in_range(v, f"{name}_expert_num", 0, 1 << 20) for name, v in special)
    checks.one_of(comm_alg, "comm_alg", OP_COMM_ALGS, "every one gives the fullmesh layout here")
    on_plat = [a for a, o in COMM_ALG_PLATFORMS.items() if plat in o[combine]]
    where = f"{on_plat} for {'combine' if combine else 'dispatch'}_v2"
    platform_feature(plat, "comm_alg", comm_alg, COMM_ALG_PLATFORMS[str(comm_alg)][combine], where)
    if plat and num_local * w > 2048:
        raise shape("moe_expert_num", f"local experts x ep_world_size exceeds 2048 ({PLATFORM_NAMES[plat]} limit)")
    # TP domain: tp_world_size 0/1 (none) or 2 (group_tp of 2 ranks, one routed expert per rank)
    tw = checks.in_range(tp_world_size, "tp_world_size", 0, 2, code="param")
    tr = checks.in_range(tp_rank_id, "tp_rank_id", 0, max(tw, 1) - 1)
    if tw == 2:
        platform_feature(plat, "tp_world_size", 2, ("a3",), "0 or 1 (TP communication is reserved)")
        if comm_alg == "hierarchy":
            raise invalid("tp_world_size", "got 2; comm_alg 'hierarchy' supports only tp_world_size <= 1")
    if elastic_info is not None:
        platform_feature(plat, "elastic_info", "a tensor", ("a3",), "None (reserved)")
    tp_group = tp() if tw == 2 and callable(tp) else None
    if tp_group is not None and tp_group.num_ranks != 2:
        raise shape("group_tp", f"has {tp_group.num_ranks} ranks, tp_world_size 2 needs 2")
    if tp_group is not None and tp_group.rank != tr:
        raise shape("tp_rank_id", f"is {tr} but this process is rank {tp_group.rank} of group_tp")
    if tp_group is not None and num_local > 1:
        why = f"gives {num_local} local experts per rank; with tp_world_size 2 each rank hosts exactly 1"
        raise shape("moe_expert_num", why)
    if elastic_info is not None and tw > 1:
        raise invalid("elastic_info", f"is only supported with tp_world_size <= 1, got tp_world_size {tw}")
    here = 1 if rank < sr else num_local
    out = Experts(
        w,
        rank,
        e,
        num_local,
        here,
        w,
        rank,
        tuple(range(w)),
        sr,
        effective,
        zero,
        copy,
        const,
        tw,
        tr,
        tp_group,
        e,
        plat,
        plain=not sr,
        scales_shared=s - effective,
    )
    return out if elastic_info is None else _elastic(out, elastic_info, s)


def _effective_shared(num: int, ranks: int, world_size: int) -> int:
    """S: 0 when there are no shared-expert ranks (the tiling forces S = 0 for SR = 0, S = 1)."""
    if ranks == 0:
        if num > 1:
            why = "(use 0 or 1, which both mean none, or set shared_expert_rank_num)"
            raise invalid("shared_expert_num", f"got {num} with shared_expert_rank_num 0; shared experts need {why}")
        return 0
    if num == 0:
        raise invalid("shared_expert_num", f"is 0 but shared_expert_rank_num is {ranks}; allowed [1, 4]")
    if ranks % num:
        raise shape("shared_expert_rank_num", f"{ranks} is not a multiple of shared_expert_num {num}")
    if ranks >= world_size:
        raise shape("shared_expert_rank_num", f"{ranks} leaves no MoE rank in {world_size} ranks")
    return num


def _elastic(e: Experts, elastic_info: object, shared_expert_num: int) -> Experts:
    """Re-lay the experts over the scaled-down EP that ``elastic_info`` describes (`[4 + 2W]` `torch.int32`:
    is_scaled_down, new_rank_count, new_shared_rank_count, new_moe_expert_count, Table1[W], Table2[W])."""
    w, info = e.world_size, checks.tensor(elastic_info, "elastic_info", (torch.int32,), 1)
    checks.dims(info, "elastic_info", (4 + 2 * w,), "(4 + 2 * ep_world_size,)")
    scaled, new_w, new_sr, new_e = (vals := info.tolist())[:4]
    checks.in_range(scaled, "elastic_info[0] (is_scaled_down)", 0, 1)
    if not scaled:
        return e
    checks.in_range(new_w, "elastic_info[1] (new_rank_count)", 1, w)
    checks.in_range(new_sr, "elastic_info[2] (new_shared_rank_count)", 0, new_w - 1)
    checks.in_range(new_e, "elastic_info[3] (new_moe_expert_count)", 1, e.scales_experts)
    if new_e % (new_w - new_sr):
        raise shape("elastic_info[3] (new_moe_expert_count)", f"{new_e} is not divisible by {new_w - new_sr} MoE ranks")
    table1, table2 = vals[4 : 4 + w], vals[4 + w : 4 + w + new_w]
    if sorted(v for v in table1 if v >= 0) != list(range(new_w)) or any(v < -1 for v in table1):
        raise shape("elastic_info", f"Table1 {table1} must map exactly {new_w} EP ranks onto 0..{new_w - 1}, others -1")
    if any(not 0 <= r < w or table1[r] != i for i, r in enumerate(table2)):
        raise shape("elastic_info", f"Table2 {table2} must be the inverse of Table1 {table1}")
    logical, num_local = table1[e.rank], new_e // (new_w - new_sr)
    return dataclasses.replace(
        e,
        num_moe_experts=new_e,
        num_local=num_local,
        num_local_here=1 if 0 <= logical < new_sr else num_local,
        logical_world_size=new_w,
        logical_rank=logical,
        ep_rank_of=tuple(table2),
        shared_expert_rank_num=new_sr,
        shared_expert_num=_effective_shared(shared_expert_num, new_sr, new_w),
        plain=False,
    )


def recv_capacity(e: Experts, global_bs: int, topk: int) -> int:
    """A: the most rows a rank can receive per TP rank (shared rank: ``maxBs * ceil(W' / R)``; with elastic_info the
    larger of both formulas, since the role of a rank can change)."""
    moe = global_bs * min(e.num_local, topk)
    if not e.shared_expert_num:
        return moe
    shared = global_bs // e.world_size * -(-e.logical_world_size // (e.shared_expert_rank_num // e.shared_expert_num))
    if e.logical_world_size != e.world_size or e.ep_rank_of != tuple(range(e.world_size)):
        return max(moe, shared)
    return shared if 0 <= e.logical_rank < e.shared_expert_rank_num else moe


def tokens(
    c: FlatDispatch | FlatCombine, x_param: str, x: Any, ids: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """x `[Bs, H]`, expert_ids `[Bs, K]` and ``c``'s x_active_mask and global_bs; returns x, ids (int64), the mask
    and global_bs_real. Only active ids are validated (the 1D mask's prefix, the 2D mask's True pairs); excluded
    entries (callers pad with ``torch.empty``) read -1 in the returned ids, so no consumer sees them."""
    e, plat, alg, global_bs = c.experts, c.experts.platform, c.comm_alg, c.global_bs
    w, param = e.world_size, c.names.get("expert_ids", "expert_ids")
    x = checks.tensor(x, x_param, NPU_ACT_DTYPES if plat else checks.ACT_DTYPES, 2)
    raw_ids = checks.tensor(ids, param, (torch.int32,) if plat else checks.ID_DTYPES, 2)
    num_tokens, hidden = x.shape
    a3_256 = plat == "a3" and alg in ("fullmesh_v2", "hierarchy")  # Atlas A3: Bs <= 256 (950: 512)
    checks.in_range(num_tokens, f"{x_param}.shape[0] (Bs)", 1 if plat else 0, 256 if a3_256 else MAX_BS)
    if plat:
        checks.in_range(hidden, f"{x_param}.shape[1] (H)", 1024, 7168 if plat == "a3" and alg == "hierarchy" else 8192)
    elif hidden < 1:
        raise shape(x_param, f"hidden size (dim 1) must be >= 1, got {hidden}")
    topk = raw_ids.shape[1]
    mask = checks.optional_tensor(c.x_active_mask, "x_active_mask", (torch.bool,), (1, 2))
    if mask is not None and mask.dim() == 1:
        checks.prefix_mask(mask, num_tokens)
    elif mask is not None and tuple(mask.shape) != (num_tokens, topk):
        why = f"2D mask shape {tuple(mask.shape)} does not match (Bs, K) = ({num_tokens}, {topk})"
        raise shape("x_active_mask", why)
    active = None if mask is None else mask.unsqueeze(1).expand(num_tokens, topk) if mask.dim() == 1 else mask
    no_expert = param == "topk_idx"  # the callers that allow -1 name it as DeepEP does
    max_k = 12 if alg == "fullmesh_v2" else checks.MAX_TOPK
    what = " (moe + zero + copy + const experts)"
    num_ids = e.num_moe_experts + e.zero_expert_num + e.copy_expert_num + e.const_expert_num
    ids_ = checks.expert_ids(raw_ids, param, num_ids, num_tokens, max_k, no_expert, what, active).long()
    global_bs = checks.global_bs(global_bs, w, num_tokens, MAX_BS)
    if plat and mask is not None and num_tokens * w != global_bs and checks.values_checked(mask) and not mask.all():
        raise shape("x_active_mask", "must be all True when batch sizes differ across ranks (global_bs != Bs*W)")
    return x, ids_, mask, global_bs


def quant(
    quant_mode: object, y_dtype: object, x_dtype: object, scales_dtype: object, x: object, plat: str | None
) -> Quant | None:
    """The flat front-ends' quantization: None for the defaults (quant_mode 0, no dtypes), else
    :func:`.platforms.dispatch_quant`'s."""
    if type(quant_mode) is int and not quant_mode and y_dtype is None and x_dtype is None and scales_dtype is None:
        return None
    return dispatch_quant(quant_mode, y_dtype, x_dtype, scales_dtype, x, plat)


def dispatch(c: FlatDispatch) -> FlatDispatch:
    """A flat dispatch checked (no communication; its ``quant`` from :func:`quant`)."""
    e = c.experts
    x, ids, mask, global_bs = tokens(c, "x", c.x, c.expert_ids)
    w, hidden, topk = e.world_size, x.shape[1], ids.shape[1]
    quant = c.quant
    checks.one_of(c.expert_token_nums_type, "expert_token_nums_type", (0, 1))
    rows, smooth, unused = e.shared_expert_num + e.scales_experts, c.names.get("scales", "scales"), e.scales_shared
    if c.scales is not None and unused and tuple(getattr(c.scales, "shape", ())) == (unused + rows, hidden):
        rows += unused  # shared_expert_num as passed without shared-expert ranks: its rows are there, unused
    scales = checks.shaped(c.scales, smooth, torch.float32, (rows, hidden), "(S + moe_expert_num, H)")
    scales = None if scales is None else scales[rows - e.shared_expert_num - e.scales_experts :]
    if scales is not None and quant is not None and quant.mode >= 4:
        raise invalid(smooth, f"quant_mode {quant.mode} (MX) takes no smooth scales: pass None")
    if e.tp is not None and quant is not None and quant.dtype != torch.int8:
        why = "does not combine with tp_world_size 2 (Atlas A3): no platform has both"
        raise invalid("quant_mode", f"{quant.mode} with y_dtype {quant.dtype} (Ascend 950) {why}")
    weights_param = c.names.get("expert_scales", "expert_scales")
    weights = checks.shaped(c.expert_scales, weights_param, torch.float32, (x.shape[0], topk), "(Bs, K)")
    perf = checks.shaped(c.wait_stats, "performance_info", torch.int64, (w,), "(ep_world_size,)")
    if c.comm_alg == "hierarchy":
        hierarchy_rules(c, "x", hidden, mask)
    if c.comm_alg == "hierarchy" and weights is None:
        raise null("expert_scales", "comm_alg 'hierarchy' needs the top-k weights, (Bs, K) float32")
    if (size := c.ccl_buffer_size) is not None:  # refuse shapes that do not fit, naming the size that would
        max_bs, alg = global_bs // w, c.comm_alg
        need = ccl_buffer_mb(ccl_buffer_bytes(w, max_bs, hidden, e.num_local, topk, e.shared_expert_num, alg))
        if size < need:
            shapes = f"W={w}, max Bs={max_bs}, H={hidden}, L={e.num_local}, K={topk}"
            raise shape("ccl_buffer_size", f"{size} MB is too small for {shapes}: at least {need} MB is needed")
    return dataclasses.replace(
        c,
        x=x,
        expert_ids=ids,
        x_active_mask=mask,
        scales=scales,
        expert_scales=weights,
        wait_stats=perf,
        num_max=global_bs // w,
        capacity=recv_capacity(e, global_bs, topk),
    )


def combine(c: FlatCombine) -> FlatCombine:
    """A flat combine checked (no communication); ``c.handle`` is ``(assist_info_for_combine, ep_send_counts,
    tp_send_counts)`` as given."""
    e = c.experts
    plat, (assist, counts, tp_counts) = e.platform, c.handle
    expand_x = checks.tensor(c.x, "expand_x", NPU_ACT_DTYPES if plat else checks.ACT_DTYPES, 2)
    probe = checks.tensor(c.expert_ids, "expert_ids", checks.ID_DTYPES, 2)  # x's shape from expert_ids, expand_x
    num_tokens, hidden = probe.shape[0], expand_x.shape[1]
    x_like = expand_x.new_empty((num_tokens, hidden), device="meta")  # shape and dtype only: no memory
    _, ids, mask, global_bs = tokens(c, "expand_x", x_like, probe)
    topk = ids.shape[1]
    assist = checks.tensor(assist, "assist_info_for_combine", (torch.int32,), 1)
    counts = checks.tensor(counts, "ep_send_counts", (torch.int32,), 1)
    weights = checks.tensor(c.expert_scales, "expert_scales", (torch.float32,), (1, 2))
    if not weights.numel() and tuple(weights.shape) != (num_tokens, topk):  # empty: a plain sum (every platform)
        weights = torch.ones((num_tokens, topk), dtype=torch.float32, device=expand_x.device)
    checks.dims(weights, "expert_scales", (num_tokens, topk), "(Bs, K)")
    shared_x = checks.optional_tensor(c.shared_expert_x, "shared_expert_x", (expand_x.dtype,), (2, 3))
    if shared_x is not None:
        if e.shared_expert_rank_num:
            raise shape("shared_expert_x", "is only allowed when shared_expert_rank_num == 0")
        if shared_x.dim() == 3:
            if shared_x.shape[0] * shared_x.shape[1] != num_tokens or shared_x.shape[2] != hidden:
                raise shape("shared_expert_x", f"3D shape {tuple(shared_x.shape)} must be (a, b, H) with a*b = Bs")
            shared_x = shared_x.reshape(num_tokens, hidden)
        checks.dims(shared_x, "shared_expert_x", (num_tokens, hidden), "(Bs, H)")
    quant = checks.in_range(c.comm_quant_mode, "comm_quant_mode", 0, 4, code="param")
    if quant == 1:
        why = "allowed 0 none, 2 int8 per 8 elements, 3 / 4 MX fp8 e5m2 / e4m3 per 32 elements (Ascend 950)"
        raise invalid("comm_quant_mode", f"got 1; {why}")
    if quant in (3, 4):
        platform_feature(plat, "comm_quant_mode", quant, ("a5",), "0 or 2")
    if quant and e.tp_world_size == 2:
        raise invalid("comm_quant_mode", f"{quant} (comm quant) is not supported with tp_world_size 2")
    if quant == 2 and hidden % 8:
        raise shape("expand_x", f"hidden {hidden} must be a multiple of 8 for comm_quant_mode 2")
    # ori_x: required iff copy or const experts exist; const_expert_*: iff const experts exist. In expand_x's dtype
    dtype, n_const = expand_x.dtype, e.const_expert_num
    ori_x = checks.shaped(c.ori_x, "ori_x", dtype, (num_tokens, hidden), "(Bs, H)")
    if (e.copy_expert_num or n_const) and ori_x is None:
        raise null("ori_x", "copy_expert_num / const_expert_num are nonzero")
    const: dict[str, Any] = {}
    for name in ("const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v"):
        const[name] = checks.shaped(getattr(c, name), name, dtype, (n_const, hidden), "(const_expert_num, H)")
        if n_const and const[name] is None:
            raise null(name, f"const_expert_num is {n_const}")
    out = checks.shaped(c.out, "out", expand_x.dtype, (num_tokens, hidden), "(Bs, H)")
    w, num_local, tp = e.world_size, e.num_local_here, max(e.tp_world_size, 1)
    perf = checks.shaped(c.wait_stats, "performance_info", torch.int64, (w,), "(ep_world_size,)")
    if c.comm_alg == "hierarchy":
        hierarchy_rules(c, "expand_x", hidden, mask)
    if counts.numel() < w * num_local * tp:
        need = f"W * L{' * 2' if tp == 2 else ''} = {w * num_local * tp}"
        raise shape("ep_send_counts", f"has {counts.numel()} entries, needs {need}")
    if e.tp_world_size == 2:
        tp_counts = checks.tensor(tp_counts, "tp_send_counts", (torch.int32,), 1)
        checks.dims(tp_counts, "tp_send_counts", (2,), "(tp_world_size,)")
    num_rows = num_peer = -1  # (not read: the engine reads them, the Ascend op takes the tensors)
    if checks.values_checked(counts):
        num_rows, num_peer = sent_rows(e, counts)
        tp_list = tp_counts.tolist() if e.tp_world_size == 2 and tp_counts is not None else None
        if tp_list is not None and tp_list != [num_rows, num_peer][:: 1 - 2 * e.tp_rank_id]:
            why = f"({num_rows} own rows, {num_peer} peer rows); pass dispatch's tp_recv_counts unchanged"
            raise shape("tp_send_counts", f"{tp_list} does not match ep_send_counts {why}")
        capacity = recv_capacity(e, global_bs, topk)
        if not (0 <= num_rows <= capacity and 0 <= num_peer <= capacity and num_rows + num_peer <= expand_x.shape[0]):
            why = f"but expand_x has {expand_x.shape[0]} and A = {capacity}"
            raise shape("ep_send_counts", f"total {num_rows} rows (+{num_peer} TP peer rows), {why}")
        if assist.numel() < 3 * num_rows:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs 3 * {num_rows}")
    return dataclasses.replace(
        c,
        x=expand_x,
        expert_ids=ids,
        x_active_mask=mask,
        expert_scales=weights,
        ori_x=ori_x,
        shared_expert_x=shared_x,
        wait_stats=perf,
        handle=(assist, counts, tp_counts),
        out=out,
        num_rows=num_rows,
        num_peer=num_peer,
        global_bs=global_bs,
        **const,
    )


def sent_rows(e: Experts, counts: torch.Tensor) -> tuple[int, int]:
    """The rows a flat combine returns (read from ``ep_send_counts``, a host read): this rank's, its TP peer's."""
    num_local, w = e.num_local_here, e.world_size
    num_rows = int(counts[w * num_local - 1])
    return num_rows, int(counts[2 * w * num_local - 1]) - num_rows if e.tp_world_size == 2 else 0
