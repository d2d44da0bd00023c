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
from typing import Any, ClassVar

import torch

from . import errors as checks
from .ep_layout import EpLayout, validate_layout
from .errors import ACT_DTYPES, MAX_TOPK, invalid, null, shape
from .npu_types import (
    dispatch_quant,
    hierarchy_rules,
    platform_feature,
)
from .quant import Quant
from .sizes import ccl_buffer_bytes, ccl_buffer_mb

NPU_ACT_DTYPES = (torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
MAX_BS = 512


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
