"""The flat (Ascend) path: validated :class:`~deep_ep_npu.params.DispatchParams` / ``CombineParams`` become engine
jobs with the :class:`~.layouts.Flat` layout, the TP stage and the copy / const experts."""

from __future__ import annotations

import torch

from ..errors import MoeDistributeError
from ..event import Completion
from ..group import EPGroup, ep_group, resolve_group
from ..params import CombineParams, DispatchParams, EpLayout, ValidDispatch, logical_rank_of, routed_pairs
from .combine import CombineJob, start_combine
from .dispatch import DispatchJob, start_dispatch
from .layouts import Flat, add_wait_time
from .plan import Plan, make_plan
from .rows import ReturnFormat, RowFormat
from .special import special_contributions
from .tp import tp_agree, tp_reduce_scatter
from .workspace import Workspace

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.int8: 4}
DISPATCH_OP, COMBINE_OP = "moe_distribute_dispatch_v2", "moe_distribute_combine_v2"
COMBINE_NAMES = (
    "moe_expert_num",
    "hidden",
    "expand_x dtype",
    "comm_quant_mode",
    "global_bs",
    "shared_expert_num",
    "shared_expert_rank_num",
    "elastic_info",
    "tp_world_size",
)


def _abort(p: DispatchParams | CombineParams, ep: EPGroup | None, err: MoeDistributeError, op: str) -> None:
    """This rank rejected its input: take part in the agreement step (EP, then TP) with the error's code, so the
    peers raise too instead of waiting. Without a usable ``group_ep`` there is no one to tell."""
    try:
        ep = ep or ep_group(resolve_group(p.group_ep, "group_ep"))
    except MoeDistributeError:
        return
    r = ep.num_ranks
    width = len(Flat.names) + 1 if op == DISPATCH_OP else 2 * r + len(COMBINE_NAMES)
    ep.start_agree(op, err.code, [[0, 0] if op == DISPATCH_OP else [] for _ in range(r)], [0] * width)()
    if p.tp_world_size == 2:
        try:
            tp = ep_group(resolve_group(p.group_tp, "group_tp"))
        except MoeDistributeError:
            return
        if tp.num_ranks == 2:
            tp_agree(tp, err.code, op)


def _run(start, job, tp: EPGroup | None, op: str, tp_fingerprint: tuple[int, ...], after=None) -> Completion:
    """``start(job)`` with the TP pair's agreement (then ``after()``) between the EP agreement and the payload."""
    told: list[bool] = []

    def before_send() -> bool:
        told.append(True)
        tp_agree(tp, 0, op, tp_fingerprint)
        return after() if after is not None else False

    job.before_send = before_send
    try:
        return start(job)
    except MoeDistributeError as err:
        if not told:
            tp_agree(tp, err.code, op)
        raise


def _plan(layout: EpLayout, token, slot, dest, expert, num_tokens: int, per_pair: bool) -> Plan:
    return make_plan(
        token, slot, dest, expert, num_tokens=num_tokens, num_ranks=layout.world_size, rank=layout.rank,
        num_local_experts=max(layout.num_local_experts, 1), per_pair_rows=per_pair,
    )  # fmt: skip


def start_dispatch_flat(p: DispatchParams, ep: EPGroup | None = None, workspace: Workspace | None = None) -> Completion:
    """Validate ``p`` and run the send phase; ``wait()`` returns the 7 outputs of ``npu_moe_distribute_dispatch_v2``
    (``ep``: the Buffer's group, default the ops' group of ``group_ep``)."""
    try:
        v = p.validate()
    except MoeDistributeError as err:
        _abort(p, ep, err, DISPATCH_OP)
        raise
    layout, x = v.layout, v.x
    ep = ep or ep_group(layout.group)
    per_pair = v.quant and v.scales is not None
    token, slot, dest, expert = routed_pairs(layout, v.ids, v.mask, ep.mask)
    plan = _plan(layout, token, slot, dest, expert, x.shape[0], per_pair)
    weights = None
    if v.expert_scales is not None:  # shared-expert copies (slot >= K) carry weight 1
        routed = plan.slot < v.topk
        weights = torch.ones(plan.token.numel(), dtype=torch.float32, device=x.device)
        weights[routed] = v.expert_scales[plan.token[routed], plan.slot[routed]]
    fmt = RowFormat(
        x.shape[1], x.dtype, "int8_per_token" if v.quant else None, v.topk + layout.shared_expert_num,
        weights is not None, False,
    )  # fmt: skip
    flat = Flat(v, weights is not None)
    fingerprint = (
        layout.num_moe_experts, x.shape[1], v.topk, 2 if v.quant else 0, v.global_bs_real, fmt.row_bytes,
        DTYPE_CODES[x.dtype], layout.shared_expert_num, layout.shared_expert_rank_num,
        hash(layout.ep_rank_of) & 0x7FFFFFFF, layout.tp_world_size, x.shape[0],
    )  # fmt: skip
    job = DispatchJob(
        ep, DISPATCH_OP, x, plan, fmt, weights, _smooth(v, plan) if per_pair else None, fingerprint, flat,
        workspace or Workspace(x.device),
    )  # fmt: skip
    tp_print = (x.shape[1], DTYPE_CODES[x.dtype] * 4 + (2 if v.quant else 0), fmt.row_bytes, layout.num_moe_experts)
    receive = _run(start_dispatch, job, layout.tp, DISPATCH_OP, tp_print)

    def finish() -> tuple[torch.Tensor, ...]:
        receive.wait()
        return flat.outputs

    return Completion(finish)


def _smooth(v: ValidDispatch, plan) -> torch.Tensor:
    """`[num_rows, H]` fp32 smooth scales of per-pair rows: row ``s`` of ``scales`` for shared expert s, row
    ``S + e`` for routed expert e."""
    layout = v.layout
    assert v.scales is not None
    logical = logical_rank_of(layout).to(plan.dest.device)[plan.dest]
    global_expert = (logical - layout.shared_expert_rank_num) * layout.num_local_experts + plan.expert
    row = torch.where(plan.slot >= v.topk, plan.slot - v.topk, layout.shared_expert_num + global_expert)
    pair_of_row = torch.empty_like(plan.row_of_pair)
    pair_of_row[plan.row_of_pair] = torch.arange(plan.row_of_pair.numel(), device=pair_of_row.device)
    return v.scales[row[pair_of_row]]


def start_combine_flat(p: CombineParams, ep: EPGroup | None = None, workspace: Workspace | None = None) -> Completion:
    """Validate ``p`` and run the send phase; ``wait()`` returns ``x`` `[Bs, H]` of ``npu_moe_distribute_combine_v2``
    (TP: the ReduceScatterV over the pair runs after the agreement step, before the EP return)."""
    try:
        v = p.validate()
    except MoeDistributeError as err:
        _abort(p, ep, err, COMBINE_OP)
        raise
    layout, expand_x = v.layout, v.expand_x
    ep = ep or ep_group(layout.group)
    dev, num_tokens, hidden = expand_x.device, v.ids.shape[0], expand_x.shape[1]
    token, slot, dest, expert = routed_pairs(layout, v.ids, v.mask, ep.mask)
    plan = _plan(layout, token, slot, dest, expert, num_tokens, True)
    weights = torch.ones(plan.token.numel(), dtype=torch.float32, device=dev)
    routed = plan.slot < v.topk
    weights[routed] = v.weights[plan.token[routed], plan.slot[routed]]
    return_rows, rows_per_src = Flat.return_rows(v.assist, v.num_rows, ep.mask)
    extra, addend, active = None, v.shared_x, None
    if layout.copy_expert_num or layout.const_expert_num:
        valid = torch.ones(v.ids.shape, dtype=torch.bool, device=dev)
        if v.mask is not None:
            valid &= v.mask.unsqueeze(1) if v.mask.dim() == 1 else v.mask
        extra = special_contributions(layout, v.ids, valid, v.weights, v.special)
    if v.mask is not None and v.mask.dim() == 1:
        active = int(v.mask.sum())  # only the active prefix is written (zero here; untouched on the NPU)
    if not layout.active:  # scaled out by elastic_info: takes no part, returns zeros
        extra, addend, active = None, None, 0
    fmt = ReturnFormat(hidden, expand_x.dtype, v.comm_quant)
    fingerprint = (
        layout.num_moe_experts, hidden, DTYPE_CODES[expand_x.dtype], 2 if v.comm_quant else 0, v.global_bs_real,
        layout.shared_expert_num, layout.shared_expert_rank_num, hash(layout.ep_rank_of) & 0x7FFFFFFF,
        layout.tp_world_size,
    )  # fmt: skip
    mismatch = (
        "assist_info_for_combine",
        "the expert_ids / x_active_mask used at dispatch and that dispatch's assist_info_for_combine and "
        "ep_recv_counts",
    )
    out = torch.empty((num_tokens, hidden), dtype=expand_x.dtype, device=dev)
    job = CombineJob(
        ep, COMBINE_OP, expand_x, return_rows, rows_per_src, plan, weights, fmt, num_tokens, out, fingerprint,
        COMBINE_NAMES, mismatch, workspace or Workspace(dev), by_slot=True, extra=extra, addend=addend,
        active=active, on_wait=lambda agreement, wait_ns: add_wait_time(v.performance_info, agreement, wait_ns),
    )  # fmt: skip
    tp_print = (hidden, DTYPE_CODES[expand_x.dtype] * 4 + (2 if v.comm_quant else 0), fmt.row_bytes,
                layout.num_moe_experts)  # fmt: skip

    def reduce_scatter() -> bool:
        if layout.tp is None:
            return False
        job.source = tp_reduce_scatter(layout.tp, layout.tp_rank_id, expand_x, v.num_rows, v.num_peer)
        return True  # the rows to return changed: pack them again

    receive = _run(start_combine, job, layout.tp, COMBINE_OP, tp_print, reduce_scatter)
    return Completion(lambda: (receive.wait(), out)[1])
