"""Typed parameters of the MoE distribute ops and the one rule set that validates them. :class:`DispatchParams` and
:class:`CombineParams` have exactly torch_npu's keyword names, are built once from the public call (the ops, the
Buffer's flat methods, MegaMoE) and validated once by ``validate()``, which returns what the engine needs. Validation
is pure (no communication) and runs first on every rank.

Without ``strict`` the rules accept the union of what the platforms do (the engine computes every feature on any
device); ``strict="a3"`` (or ``True``) adds the Atlas A3 limits and refuses the Ascend 950 features, ``strict="a5"``
adds the Ascend 950 (A5) limits and refuses the Atlas A3 ones, each error naming the platform a feature belongs to
(:func:`~deep_ep_npu.npu_types.platform_feature`). Sources: the aclnn ``MoeDistributeDispatchV4`` /
``CombineV4`` docs' per-product blocks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from . import errors as checks
from .errors import ACT_DTYPES, MAX_TOPK, invalid, null, shape
from .group import EPGroup, ep_group
from .group_names import resolve_group
from .npu_types import (
    COMM_ALG_PLATFORMS,
    MAX_WORLD,
    OP_COMM_ALGS,
    PLATFORM_NAMES,
    dispatch_quant,
    hierarchy_rules,
    platform,
    platform_feature,
)
from .quant import Quant
from .sizes import ccl_buffer_bytes, ccl_buffer_mb

NPU_ACT_DTYPES = (torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
MAX_BS = 512


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Where experts live. Ranks are addressed by their *logical* rank: the EP rank itself, or with ``elastic_info``
    the rank in the scaled-down EP (``Table1[ep_rank]``, -1 for ranks that do not take part). Logical ranks
    ``[0, SR)`` host shared experts, the rest ``L`` routed experts each; ``ep_rank_of[logical]`` is the EP rank."""

    group: dist.ProcessGroup
    world_size: int  # W: ranks of group_ep (the communication domain)
    rank: int
    num_moe_experts: int  # E in the active layout (elastic: new_moe_expert_count)
    shared_expert_rank_num: int  # SR in the active layout
    shared_expert_num: int  # effective S (0 when SR == 0)
    zero_expert_num: int
    copy_expert_num: int
    const_expert_num: int
    tp_world_size: int
    tp_rank_id: int
    logical_world_size: int = 0  # W' (== W without elastic_info)
    logical_rank: int = 0  # -1: this rank does not take part (elastic)
    ep_rank_of: tuple[int, ...] = ()  # logical rank -> EP rank
    tp: EPGroup | None = None
    scales_experts: int = 0  # moe_expert_num as given (rows of ``scales`` after the shared ones)
    platform: str | None = None  # strict's platform: None, "a3" or "a5"

    @property
    def num_local_experts(self) -> int:  # L: routed experts per MoE rank
        return self.num_moe_experts // (self.logical_world_size - self.shared_expert_rank_num)

    @property
    def active(self) -> bool:  # False for a rank that elastic_info scaled out: it sends and receives nothing
        return self.logical_rank >= 0

    @property
    def num_local_experts_here(self) -> int:
        return 1 if 0 <= self.logical_rank < self.shared_expert_rank_num else self.num_local_experts

    def recv_capacity(self, global_bs: int, topk: int) -> int:
        """A: the most rows this rank can receive per TP rank (shared rank: ``maxBs * ceil(W / R)``; with
        elastic_info the larger of both formulas, since the role of a rank can change)."""
        moe = global_bs * min(self.num_local_experts, topk)
        if not self.shared_expert_num:
            return moe
        ranks_per_shared = self.shared_expert_rank_num // self.shared_expert_num
        shared = global_bs // self.world_size * math.ceil(self.logical_world_size / ranks_per_shared)
        if self.logical_world_size != self.world_size or self.ep_rank_of != tuple(range(self.world_size)):
            return max(moe, shared)
        return shared if 0 <= self.logical_rank < self.shared_expert_rank_num else moe


def validate_layout(p: DispatchParams | CombineParams) -> EpLayout:
    """The expert layout of ``p``'s group and expert keywords (no communication)."""
    plat = platform(p.strict)
    pg = resolve_group(p.group_ep, "group_ep")
    checks.in_range(p.ep_world_size, "ep_world_size", 2 if plat else 1, MAX_WORLD[plat])
    if p.ep_world_size != dist.get_world_size(pg):
        raise shape("ep_world_size", f"is {p.ep_world_size} but group_ep has {dist.get_world_size(pg)} ranks")
    checks.in_range(p.ep_rank_id, "ep_rank_id", 0, p.ep_world_size - 1)
    if p.ep_rank_id != dist.get_rank(pg):
        raise shape("ep_rank_id", f"is {p.ep_rank_id} but this process is rank {dist.get_rank(pg)} of group_ep")
    checks.in_range(p.moe_expert_num, "moe_expert_num", 1, 1024 if plat else 1 << 20)
    checks.in_range(p.expert_shard_type, "expert_shard_type", 0, 0, code="param")
    checks.in_range(p.shared_expert_num, "shared_expert_num", 0, 4, code="param")
    checks.in_range(p.shared_expert_rank_num, "shared_expert_rank_num", 0, p.ep_world_size - 1)
    effective_shared = _effective_shared(p.shared_expert_num, p.shared_expert_rank_num, p.ep_world_size)
    num_local = p.moe_expert_num // (moe_ranks := p.ep_world_size - p.shared_expert_rank_num)
    if p.moe_expert_num % moe_ranks:
        raise shape("moe_expert_num", f"{p.moe_expert_num} is not divisible by the {moe_ranks} MoE ranks "
                    "(ep_world_size - shared_expert_rank_num)")  # fmt: skip
    for name in ("zero_expert_num", "copy_expert_num", "const_expert_num"):
        checks.in_range(getattr(p, name), name, 0, 1 << 20)
    checks.one_of(p.comm_alg, "comm_alg", OP_COMM_ALGS, "every one gives the fullmesh layout here")
    combine = isinstance(p, CombineParams)
    on_plat = [a for a, o in COMM_ALG_PLATFORMS.items() if plat in o[combine]]
    where = f"{on_plat} for {'combine' if combine else 'dispatch'}_v2"
    platform_feature(plat, "comm_alg", p.comm_alg, COMM_ALG_PLATFORMS[p.comm_alg][combine], where)
    if plat and num_local * p.ep_world_size > 2048:
        raise shape("moe_expert_num", f"local experts x ep_world_size exceeds 2048 ({PLATFORM_NAMES[plat]} limit)")
    # TP domain: tp_world_size 0/1 (none) or 2 (group_tp of 2 ranks, one routed expert per rank)
    checks.in_range(p.tp_world_size, "tp_world_size", 0, 2, code="param")
    checks.in_range(p.tp_rank_id, "tp_rank_id", 0, max(p.tp_world_size, 1) - 1)
    if p.tp_world_size == 2:
        platform_feature(plat, "tp_world_size", 2, ("a3",), "0 or 1 (TP communication is reserved)")
        if p.comm_alg == "hierarchy":
            raise invalid("tp_world_size", "got 2; comm_alg 'hierarchy' supports only tp_world_size <= 1")
    if p.elastic_info is not None:
        platform_feature(plat, "elastic_info", "a tensor", ("a3",), "None (reserved)")
    tp = resolve_group(p.group_tp, "group_tp") if p.tp_world_size == 2 else None
    if tp is not None and dist.get_world_size(tp) != 2:
        raise shape("group_tp", f"has {dist.get_world_size(tp)} ranks, tp_world_size 2 needs 2")
    if tp is not None and dist.get_rank(tp) != p.tp_rank_id:
        raise shape("tp_rank_id", f"is {p.tp_rank_id} but this process is rank {dist.get_rank(tp)} of group_tp")
    if tp is not None and num_local > 1:
        why = f"gives {num_local} local experts per rank; with tp_world_size 2 each rank hosts exactly 1"
        raise shape("moe_expert_num", why)
    if p.elastic_info is not None and p.tp_world_size > 1:
        why = f"is only supported with tp_world_size <= 1, got tp_world_size {p.tp_world_size}"
        raise invalid("elastic_info", why)
    layout = EpLayout(
        pg, p.ep_world_size, p.ep_rank_id, p.moe_expert_num, p.shared_expert_rank_num, effective_shared,
        p.zero_expert_num, p.copy_expert_num, p.const_expert_num, p.tp_world_size, p.tp_rank_id, p.ep_world_size,
        p.ep_rank_id, tuple(range(p.ep_world_size)), None if tp is None else ep_group(tp), p.moe_expert_num, plat,
    )  # fmt: skip
    return layout if p.elastic_info is None else apply_elastic(layout, p.elastic_info, p.shared_expert_num)


def _effective_shared(num: int, ranks: int, world_size: int) -> int:
    """S: 0 when there are no shared-expert ranks (the tiling forces S = 0 for SR = 0, S = 1)."""
    if ranks == 0:
        if num > 1:
            raise invalid("shared_expert_num", f"got {num} with shared_expert_rank_num 0; shared experts need shared-"
                          "expert ranks (use 0 or 1, which both mean none, or set shared_expert_rank_num)")  # fmt: skip
        return 0
    if num == 0:
        raise invalid("shared_expert_num", f"is 0 but shared_expert_rank_num is {ranks}; allowed [1, 4]")
    if ranks % num:
        raise shape("shared_expert_rank_num", f"{ranks} is not a multiple of shared_expert_num {num}")
    if ranks >= world_size:
        raise shape("shared_expert_rank_num", f"{ranks} leaves no MoE rank in {world_size} ranks")
    return num


def apply_elastic(layout: EpLayout, elastic_info: object, shared_expert_num: int) -> EpLayout:
    """Re-lay the experts over the scaled-down EP that ``elastic_info`` describes (`[4 + 2W]` `torch.int32`:
    is_scaled_down, new_rank_count, new_shared_rank_count, new_moe_expert_count, Table1[W], Table2[W])."""
    w, info = layout.world_size, checks.tensor(elastic_info, "elastic_info", (torch.int32,), 1)
    checks.dims(info, "elastic_info", (4 + 2 * w,), "(4 + 2 * ep_world_size,)")
    scaled, new_w, new_sr, new_e = (vals := info.tolist())[:4]
    checks.in_range(scaled, "elastic_info[0] (is_scaled_down)", 0, 1)
    if not scaled:
        return layout
    checks.in_range(new_w, "elastic_info[1] (new_rank_count)", 1, w)
    checks.in_range(new_sr, "elastic_info[2] (new_shared_rank_count)", 0, new_w - 1)
    checks.in_range(new_e, "elastic_info[3] (new_moe_expert_count)", 1, layout.scales_experts)
    if new_e % (new_w - new_sr):
        raise shape("elastic_info[3] (new_moe_expert_count)", f"{new_e} is not divisible by {new_w - new_sr} MoE ranks")
    table1, table2 = vals[4 : 4 + w], vals[4 + w : 4 + w + new_w]
    if sorted(v for v in table1 if v >= 0) != list(range(new_w)) or any(v < -1 for v in table1):
        raise shape("elastic_info", f"Table1 {table1} must map exactly {new_w} EP ranks onto 0..{new_w - 1}, others -1")
    if any(not 0 <= e < w or table1[e] != i for i, e in enumerate(table2)):
        raise shape("elastic_info", f"Table2 {table2} must be the inverse of Table1 {table1}")
    return dataclasses.replace(
        layout, num_moe_experts=new_e, shared_expert_rank_num=new_sr,
        shared_expert_num=_effective_shared(shared_expert_num, new_sr, new_w),
        logical_world_size=new_w, logical_rank=table1[layout.rank], ep_rank_of=tuple(table2),
    )  # fmt: skip


def _tokens(layout: EpLayout, p: DispatchParams | CombineParams, x_param: str, x: object, ids: object):
    """x `[Bs, H]`, expert_ids `[Bs, K]` and ``p``'s x_active_mask and global_bs; returns x, ids (int64), mask, K
    and global_bs_real. Only active ids are validated (the 1D mask's prefix, the 2D mask's True pairs); excluded
    entries (callers pad with ``torch.empty``) read -1 in the returned ids, so no consumer sees them."""
    plat, alg, w, global_bs = layout.platform, p.comm_alg, layout.world_size, p.global_bs
    param = "topk_idx" if p.no_expert else "expert_ids"  # the callers that allow -1 name it as DeepEP does
    x = checks.tensor(x, x_param, NPU_ACT_DTYPES if plat else ACT_DTYPES, 2)
    raw_ids = checks.tensor(ids, param, (torch.int32,) if plat else ID_DTYPES, 2)
    num_tokens, hidden = x.shape
    a3_256 = plat == "a3" and alg in ("fullmesh_v2", "hierarchy")  # Atlas A3: Bs <= 256 (950: 512)
    checks.in_range(num_tokens, f"{x_param}.shape[0] (Bs)", 1 if plat else 0, 256 if a3_256 else MAX_BS)
    if plat:
        checks.in_range(hidden, f"{x_param}.shape[1] (H)", 1024, 7168 if plat == "a3" and alg == "hierarchy" else 8192)
    elif hidden < 1:
        raise shape(x_param, f"hidden size (dim 1) must be >= 1, got {hidden}")
    topk = raw_ids.shape[1]
    mask = checks.optional_tensor(p.x_active_mask, "x_active_mask", (torch.bool,), (1, 2))
    if mask is not None and mask.dim() == 1:
        checks.prefix_mask(mask, num_tokens)
    elif mask is not None and tuple(mask.shape) != (num_tokens, topk):
        why = f"2D mask shape {tuple(mask.shape)} does not match (Bs, K) = ({num_tokens}, {topk})"
        raise shape("x_active_mask", why)
    active = None if mask is None else mask.unsqueeze(1).expand(num_tokens, topk) if mask.dim() == 1 else mask
    num_ids = layout.num_moe_experts + layout.zero_expert_num + layout.copy_expert_num + layout.const_expert_num
    what = " (moe + zero + copy + const experts)"
    max_k = 12 if alg == "fullmesh_v2" else MAX_TOPK
    ids_ = checks.expert_ids(raw_ids, param, num_ids, num_tokens, max_k, p.no_expert, what, active).long()
    checks.in_range(global_bs, "global_bs", 0, MAX_BS * w)
    if global_bs:
        if global_bs % w:
            raise shape("global_bs", f"{global_bs} is not a multiple of ep_world_size {w} (pass max Bs x W)")
        if num_tokens > global_bs // w:
            raise shape("global_bs", f"{global_bs} / W = {global_bs // w} is below this rank's Bs {num_tokens}")
        if plat and mask is not None and num_tokens * w != global_bs and not bool(mask.all()):
            raise shape("x_active_mask", "must be all True when batch sizes differ across ranks (global_bs != Bs*W)")
    return x, ids_, mask, topk, global_bs or num_tokens * w


@dataclasses.dataclass
class _Common:
    """The keywords both ops take (same names and defaults)."""

    _: dataclasses.KW_ONLY
    x_active_mask: Any = None
    elastic_info: Any = None
    performance_info: Any = None
    group_tp: Any = ""
    tp_world_size: Any = 0
    tp_rank_id: Any = 0
    expert_shard_type: Any = 0
    shared_expert_num: Any = 1
    shared_expert_rank_num: Any = 0
    global_bs: Any = 0
    comm_alg: Any = ""
    zero_expert_num: Any = 0
    copy_expert_num: Any = 0
    const_expert_num: Any = 0
    strict: Any = False
    no_expert: bool = False


@dataclasses.dataclass
class DispatchParams(_Common):
    """The arguments of :func:`deep_ep_npu.ops.moe_distribute_dispatch_v2` by torch_npu's keyword names, plus
    ``ccl_buffer_size`` / ``strict`` (ours) and ``no_expert`` (internal, for the Buffer's flat methods and MegaMoE: -1
    in ``expert_ids`` means "no expert", named ``topk_idx`` in errors, as DeepEP)."""

    op: ClassVar[str] = "moe_distribute_dispatch_v2"  # the op named in errors and failures
    x: Any
    expert_ids: Any
    group_ep: Any
    ep_world_size: Any
    ep_rank_id: Any
    moe_expert_num: Any
    _: dataclasses.KW_ONLY
    scales: Any = None
    expert_scales: Any = None
    quant_mode: Any = 0
    expert_token_nums_type: Any = 1
    y_dtype: Any = None
    x_dtype: Any = None
    scales_dtype: Any = None
    ccl_buffer_size: Any = None

    def validate(self) -> ValidDispatch:
        """Check every argument (no communication); raise ``MoeDistributeError`` naming the first bad one."""
        layout = validate_layout(self)
        x, ids, mask, topk, global_bs = _tokens(layout, self, "x", self.x, self.expert_ids)
        w, hidden, num_local = layout.world_size, x.shape[1], layout.num_local_experts
        quant = dispatch_quant(self, x.dtype, layout.platform)
        checks.one_of(self.expert_token_nums_type, "expert_token_nums_type", (0, 1))
        rows = layout.shared_expert_num + layout.scales_experts
        scales = checks.shaped(self.scales, "scales", torch.float32, (rows, hidden), "(S + moe_expert_num, H)")
        if scales is not None and quant is not None and quant.mode == 4:
            raise invalid("scales", "quant_mode 4 (MX) takes no smooth scales: pass None")
        if layout.tp is not None and quant is not None and quant.dtype != torch.int8:
            raise invalid("quant_mode", f"{quant.mode} with y_dtype {quant.dtype} (Ascend 950) does not combine with "
                          "tp_world_size 2 (Atlas A3): no platform has both")  # fmt: skip
        expert_scales = checks.shaped(self.expert_scales, "expert_scales", torch.float32, (x.shape[0], topk), "(Bs, K)")
        perf = checks.shaped(self.performance_info, "performance_info", torch.int64, (w,), "(ep_world_size,)")
        hierarchy_rules(self, layout, "x", hidden, mask)
        if self.comm_alg == "hierarchy" and expert_scales is None:
            raise null("expert_scales", "comm_alg 'hierarchy' needs the top-k weights, (Bs, K) float32")
        if (size := self.ccl_buffer_size) is not None:  # refuse shapes that do not fit, naming the size that would
            max_bs = global_bs // w
            num_bytes = ccl_buffer_bytes(w, max_bs, hidden, num_local, topk, layout.shared_expert_num, self.comm_alg)
            if size < (need := ccl_buffer_mb(num_bytes)):
                raise shape("ccl_buffer_size", f"{size} MB is too small for W={w}, max Bs={max_bs}, H={hidden}, "
                            f"L={num_local}, K={topk}: at least {need} MB is needed")  # fmt: skip
        return ValidDispatch(layout, x, ids, mask, topk, self.global_bs, global_bs, quant, scales, expert_scales, perf,
                             self.expert_token_nums_type)  # fmt: skip


@dataclasses.dataclass
class ValidDispatch:
    """A validated dispatch: ``ids`` `[Bs, K]` int64 (-1 where x_active_mask excludes a pair); ``global_bs_real`` =
    ``global_bs or Bs * W``; ``quant``: the quantization to run (None: quant_mode 0)."""

    layout: EpLayout
    x: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor | None
    topk: int
    global_bs: int
    global_bs_real: int
    quant: Quant | None
    scales: torch.Tensor | None
    expert_scales: torch.Tensor | None
    performance_info: torch.Tensor | None
    expert_token_nums_type: int


@dataclasses.dataclass
class CombineParams(_Common):
    """The arguments of :func:`deep_ep_npu.ops.moe_distribute_combine_v2` by torch_npu's keyword names, plus ``strict``
    (ours) and ``no_expert`` (internal, as in :class:`DispatchParams`)."""

    expand_x: Any
    expert_ids: Any
    assist_info_for_combine: Any
    ep_send_counts: Any
    expert_scales: Any
    group_ep: Any
    ep_world_size: Any
    ep_rank_id: Any
    moe_expert_num: Any
    _: dataclasses.KW_ONLY
    tp_send_counts: Any = None
    expand_scales: Any = None
    shared_expert_x: Any = None
    ori_x: Any = None
    const_expert_alpha_1: Any = None
    const_expert_alpha_2: Any = None
    const_expert_v: Any = None
    comm_quant_mode: Any = 0

    def validate(self) -> ValidCombine:
        """Check every argument (no communication), as :meth:`DispatchParams.validate`."""
        layout = validate_layout(self)
        expand_x = checks.tensor(self.expand_x, "expand_x", NPU_ACT_DTYPES if layout.platform else ACT_DTYPES, 2)
        probe = checks.tensor(self.expert_ids, "expert_ids", ID_DTYPES, 2)  # x's shape from expert_ids, expand_x
        num_tokens, hidden = probe.shape[0], expand_x.shape[1]
        x_like = expand_x.new_empty((num_tokens, hidden), device="meta")  # shape and dtype only: no memory
        _, ids, mask, topk, global_bs = _tokens(layout, self, "expand_x", x_like, probe)
        assist = checks.tensor(self.assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
        counts = checks.tensor(self.ep_send_counts, "ep_send_counts", (torch.int32,), 1)
        weights = checks.tensor(self.expert_scales, "expert_scales", (torch.float32,), (1, 2))
        if not weights.numel() and tuple(weights.shape) != (num_tokens, topk):  # Ascend 950: empty = a plain sum
            platform_feature(layout.platform, "expert_scales", "an empty tensor", ("a5",), "a (Bs, K) tensor")
            weights = torch.ones((num_tokens, topk), dtype=torch.float32, device=expand_x.device)
        checks.dims(weights, "expert_scales", (num_tokens, topk), "(Bs, K)")
        shared_x = checks.optional_tensor(self.shared_expert_x, "shared_expert_x", (expand_x.dtype,), (2, 3))
        if shared_x is not None:
            if layout.shared_expert_rank_num:
                raise shape("shared_expert_x", "is only allowed when shared_expert_rank_num == 0")
            if shared_x.dim() == 3:
                if shared_x.shape[0] * shared_x.shape[1] != num_tokens or shared_x.shape[2] != hidden:
                    raise shape("shared_expert_x", f"3D shape {tuple(shared_x.shape)} must be (a, b, H) with a*b = Bs")
                shared_x = shared_x.reshape(num_tokens, hidden)
            checks.dims(shared_x, "shared_expert_x", (num_tokens, hidden), "(Bs, H)")
        quant = checks.in_range(self.comm_quant_mode, "comm_quant_mode", 0, 4, code="param")
        if quant == 1:
            why = "allowed 0 none, 2 int8 per 8 elements, 3 / 4 MX fp8 e5m2 / e4m3 per 32 elements (Ascend 950)"
            raise invalid("comm_quant_mode", f"got 1; {why}")
        if quant in (3, 4):
            platform_feature(layout.platform, "comm_quant_mode", quant, ("a5",), "0 or 2")
        if quant and layout.tp_world_size == 2:
            raise invalid("comm_quant_mode", f"{quant} (comm quant) is not supported with tp_world_size 2")
        if quant == 2 and hidden % 8:
            raise shape("expand_x", f"hidden {hidden} must be a multiple of 8 for comm_quant_mode 2")
        # ori_x: required iff copy or const experts exist; const_expert_*: iff const experts exist. In expand_x's dtype
        dtype, n_const = expand_x.dtype, layout.const_expert_num
        special = {"ori_x": checks.shaped(self.ori_x, "ori_x", dtype, (num_tokens, hidden), "(Bs, H)")}
        if (layout.copy_expert_num or n_const) and special["ori_x"] is None:
            raise null("ori_x", "copy_expert_num / const_expert_num are nonzero")
        for name in ("const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v"):
            special[name] = checks.shaped(getattr(self, name), name, dtype, (n_const, hidden), "(const_expert_num, H)")
            if n_const and special[name] is None:
                raise null(name, f"const_expert_num is {n_const}")
        w, num_local, tp = layout.world_size, layout.num_local_experts_here, max(layout.tp_world_size, 1)
        perf = checks.shaped(self.performance_info, "performance_info", torch.int64, (w,), "(ep_world_size,)")
        hierarchy_rules(self, layout, "expand_x", hidden, mask)
        if counts.numel() < w * num_local * tp:
            need = f"W * L{' * 2' if tp == 2 else ''} = {w * num_local * tp}"
            raise shape("ep_send_counts", f"has {counts.numel()} entries, needs {need}")
        num_rows, num_peer = int(counts[w * num_local - 1]), 0
        if layout.tp_world_size == 2:
            tp_counts = checks.tensor(self.tp_send_counts, "tp_send_counts", (torch.int32,), 1)
            checks.dims(tp_counts, "tp_send_counts", (2,), "(tp_world_size,)")
            num_peer = int(counts[2 * w * num_local - 1]) - num_rows
            if int(tp_counts[layout.tp_rank_id]) != num_rows or int(tp_counts[1 - layout.tp_rank_id]) != num_peer:
                raise shape("tp_send_counts", f"{tp_counts.tolist()} does not match ep_send_counts ({num_rows} own "
                            f"rows, {num_peer} peer rows); pass dispatch's tp_recv_counts unchanged")  # fmt: skip
        capacity = layout.recv_capacity(global_bs, topk)
        if not (0 <= num_rows <= capacity and 0 <= num_peer <= capacity and num_rows + num_peer <= expand_x.shape[0]):
            raise shape("ep_send_counts", f"total {num_rows} rows (+{num_peer} TP peer rows), but expand_x has "
                        f"{expand_x.shape[0]} and A = {capacity}")  # fmt: skip
        if assist.numel() < 3 * num_rows:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs 3 * {num_rows}")
        return ValidCombine(layout, expand_x, ids, mask, topk, global_bs, weights, shared_x, quant, special, perf,
                            assist, num_rows, num_peer)  # fmt: skip


@dataclasses.dataclass
class ValidCombine:
    """A validated combine: ``num_rows`` own rows of ``expand_x`` (then ``num_peer`` TP peer rows); ``ids`` as in
    :class:`ValidDispatch`; ``comm_quant``: comm_quant_mode (0, 2, 3, 4)."""

    layout: EpLayout
    expand_x: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor | None
    topk: int
    global_bs_real: int
    weights: torch.Tensor
    shared_x: torch.Tensor | None
    comm_quant: int
    special: dict[str, torch.Tensor | None]
    performance_info: torch.Tensor | None
    assist: torch.Tensor
    num_rows: int
    num_peer: int


def routed_pairs(layout: EpLayout, ids: torch.Tensor, x_active_mask: torch.Tensor | None,
                 rank_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(token, slot, dest EP rank, local expert) of every pair that is sent, each `[num_pairs]` `torch.int64`.
    A pair (t, k) is sent iff it is active (t inside the 1D mask's prefix, or ``mask[t, k]``) and its id is a routed
    expert (``0 <= id < moe_expert_num``); zero / copy / const experts are handled by combine on the source rank.
    Every active token also goes to shared expert s (slot ``K + s``) on logical rank ``(rank % R) + s * R``. A rank
    that elastic_info scaled out, or that ``rank_mask`` `[W]` marks, sends nothing; nothing goes to marked ranks."""
    dev, empty = ids.device, torch.empty((0,), dtype=torch.int64, device=ids.device)
    if not layout.active or bool(rank_mask[layout.rank]):
        return empty, empty, empty, empty
    valid = (ids >= 0) & (ids < layout.num_moe_experts)
    if x_active_mask is not None:
        valid &= x_active_mask.unsqueeze(1) if x_active_mask.dim() == 1 else x_active_mask
    token, slot = valid.nonzero(as_tuple=True)
    e, num_local = ids[token, slot], layout.num_local_experts
    parts = [(token, slot, layout.shared_expert_rank_num + e // num_local, e % num_local)]
    if layout.shared_expert_num:
        act = active_tokens(x_active_mask, ids.shape[0], dev)
        r = layout.shared_expert_rank_num // layout.shared_expert_num  # ranks per shared expert
        for s in range(layout.shared_expert_num):
            slot_s, logical_s = ids.shape[1] + s, layout.logical_rank % r + s * r
            parts.append((act, torch.full_like(act, slot_s), torch.full_like(act, logical_s), torch.zeros_like(act)))
    token, slot, logical, expert = (torch.cat(c) for c in zip(*parts, strict=True))
    dest = torch.tensor(layout.ep_rank_of, dtype=torch.int64, device=dev)[logical]
    if bool(rank_mask.any()):
        keep = rank_mask.to(dev)[dest] == 0
        token, slot, dest, expert = token[keep], slot[keep], dest[keep], expert[keep]
    return token, slot, dest, expert


def active_tokens(x_active_mask: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Tokens sent to the shared experts, `[n]` `torch.int64`: all, the 1D mask's prefix, or (2D mask) the tokens
    with at least one active pair."""
    if x_active_mask is None:
        return torch.arange(num_tokens, device=device)
    if x_active_mask.dim() == 1:
        return torch.arange(int(x_active_mask.sum()), device=device)
    return x_active_mask.any(dim=1).nonzero().squeeze(1)


def logical_rank_of(layout: EpLayout) -> torch.Tensor:
    """`[W]` `torch.int64`: the logical rank of each EP rank (-1: scaled out)."""
    out = torch.full((layout.world_size,), -1, dtype=torch.int64)
    out[torch.tensor(layout.ep_rank_of, dtype=torch.int64)] = torch.arange(len(layout.ep_rank_of))
    return out
