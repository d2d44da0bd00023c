"""The flat (Ascend) path: validated :class:`~deep_ep_npu.params.DispatchParams` / ``CombineParams`` become engine
jobs with the :class:`Flat` layout (the TP stage: :mod:`.tp`) and the zero / copy / const experts."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import kernels as cpu_kernels
from ..ep_layout import EpLayout, logical_rank_of, routed_pairs
from ..errors import MoeDistributeError, shape
from ..event import Completion
from ..group import DTYPE_CODES, Agreement, EPGroup, ep_group
from ..group_names import resolve_group
from ..npu_types import OP_COMM_ALGS, SCALAR_TYPE_CODE
from ..params import CombineParams, DispatchParams, ValidCombine, ValidDispatch
from .combine import CombineJob
from .dispatch import DispatchJob, Incoming
from .layouts import sort_blocks
from .plan import Plan, make_plan, plan_topk
from .rows import ReturnFormat, RowFormat
from .tp import tp_agree, tp_gather_rows, tp_reduce_scatter, with_tp_agreement
from .transport import Collective, Transport
from .workspace import Workspace

COMBINE_OP = "moe_distribute_combine_v2"
COMBINE_NAMES = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "global_bs", "shared_expert_num",
                 "shared_expert_rank_num", "elastic_info", "tp_world_size", "comm_alg")  # fmt: skip


class Flat:
    """Ascend's layout: the 7 outputs of ``npu_moe_distribute_dispatch_v2`` (see :mod:`deep_ep_npu.ops`), filled by
    :meth:`place_remote` into :attr:`outputs`. With a TP pair, the TP peer's rows follow this rank's own."""

    names = ("moe_expert_num", "hidden", "topk", "quant_mode", "global_bs", "row_bytes", "x dtype", "shared_expert_num",
             "shared_expert_rank_num", "elastic_info", "tp_world_size", "y_dtype", "comm_alg")  # fmt: skip

    def __init__(self, v: ValidDispatch, weights: bool) -> None:
        self.v, self.weights, self.outputs = v, weights, tuple[torch.Tensor, ...]()
        self.capacity = v.layout.recv_capacity(v.global_bs_real, v.topk)

    def check(self, agreement: Agreement) -> None:
        agreement.check(self.v.layout.rank, ())
        batch = [fp[-1] for fp in agreement.shared]
        if self.v.global_bs == 0 and len(set(batch)) > 1:
            why = f"is 0 but x has different batch sizes across ranks (per rank: {batch}); pass global_bs = max(Bs) * W"
            raise shape("global_bs", why)
        agreement.check(self.v.layout.rank, self.names)

    def place_own(self, *_: Any) -> None:
        """Nothing yet: own rows are placed with the remote ones (their positions depend on every source's counts)."""

    def place_own_direct(self, *_: Any) -> bool:
        """No: own rows are packed (and placed with the remote ones)."""
        return False

    def place_remote(self, fmt: RowFormat, incoming: Incoming, own: Incoming, agreement: Agreement,
                     wait_ns: int) -> None:  # fmt: skip
        v, layout, cap = self.v, self.v.layout, self.capacity
        dev, w, num_local = v.x.device, layout.world_size, layout.num_local_experts_here
        hidden, tp, q = v.x.shape[1], 1 if layout.tp is None else 2, v.quant
        width, scale_dtype = ((), torch.float32) if q is None else (q.scale_shape(hidden), q.scale_dtype)
        if q is None and v.scales is not None and v.scales.shape[1]:  # quant_mode 0 given scales: `[A, H]` zeros
            width = (v.scales.shape[1],)
        expand_x = torch.empty((cap * tp, hidden), dtype=fmt.data_dtype, device=dev)
        scale_bytes = torch.empty((cap * tp, math.prod(width) * scale_dtype.itemsize), dtype=torch.uint8, device=dev)
        dynamic_scales = scale_bytes.view(scale_dtype).view(cap * tp, *width)
        assist = torch.empty((max(v.x.shape[0] * v.topk, cap * 128),), dtype=torch.int32, device=dev)
        expand_scales = torch.empty((cap if self.weights else 0,), dtype=torch.float32, device=dev)
        counts = torch.zeros((num_local, w), dtype=torch.int64, device=dev)
        carried = 0 if q is None else fmt.scale_end - fmt.scale_off  # scale bytes per row that travel
        num_recv = cpu_kernels.place_flat(incoming.sources() + own.sources(), fmt, carried, self.weights, counts,
                                          expand_x[:cap], scale_bytes[:cap], assist, expand_scales)  # fmt: skip
        if num_recv is None:
            num_recv, counts = self._place(fmt, incoming, own, expand_x, scale_bytes, assist, expand_scales)
        elif num_recv < 0:
            num_recv = int(counts.sum())
        if num_recv > cap:
            raise shape("expert_ids", f"this rank received {num_recv} rows but can hold A = {cap}")
        for t, rows_used in ((expand_x, num_recv), (scale_bytes, carried and num_recv), (assist, 3 * num_recv)):
            t[rows_used:] = 0  # (the rows past the received ones read as zeros; scales that do not travel, all)
        expand_scales[num_recv:] = 0
        all_counts = counts.reshape(-1)
        tp_recv_counts = torch.full((layout.tp_world_size,), num_recv, dtype=torch.int32, device=dev)
        if layout.tp is not None:  # append the TP peer's received rows and counts
            all_counts, tp_recv_counts[1 - layout.tp_rank_id] = tp_gather_rows(
                layout.tp, layout.tp_rank_id, expand_x, dynamic_scales, num_recv, all_counts
            )
        per_expert = all_counts.view(tp, num_local, w).sum(dim=(0, 2))
        expert_token_nums = (per_expert.cumsum(0) if v.expert_token_nums_type == 0 else per_expert).to(torch.int64)
        extra = 2 * v.global_bs * v.topk * (w // 8) if self.weights and layout.platform != "a5" else 0
        ep_recv_counts = torch.zeros((all_counts.numel() + extra,), dtype=torch.int32, device=dev)
        ep_recv_counts[: all_counts.numel()] = all_counts.cumsum(0).to(torch.int32)
        add_wait_time(v.performance_info, agreement, wait_ns)
        self.outputs = (expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts,
                        expand_scales)  # fmt: skip

    def _place(self, fmt: RowFormat, incoming: Incoming, own: Incoming, expand_x: torch.Tensor,
               scale_bytes: torch.Tensor, assist: torch.Tensor,
               expand_scales: torch.Tensor) -> tuple[int, torch.Tensor]:  # fmt: skip
        """:meth:`place_remote`'s placement in torch (where :func:`~.cpu_kernels.place_flat` does not apply): returns
        the pairs received and their counts `[L, R]`; writes nothing when they exceed the capacity."""
        layout, cap, dev = self.v.layout, self.capacity, self.v.x.device
        rows, got, own_rows, own_got = incoming.rows, incoming.parse(fmt), own.rows, own.parse(fmt)
        expert, src = torch.cat([got.expert, own_got.expert]), torch.cat([got.src, own_got.src])
        num_recv = int(expert.numel())
        order, counts = sort_blocks(expert, src, layout.num_local_experts_here, layout.world_size)
        if num_recv > cap:
            return num_recv, counts
        position = torch.empty_like(order)
        position[order] = torch.arange(num_recv, device=dev)  # final row of each pair (remote pairs first, then own)
        n_remote = got.row.numel()
        for buf, part, at in ((rows, got, position[:n_remote]), (own_rows, own_got, position[n_remote:])):
            if not at.numel():
                continue
            fmt.scatter_data(buf, part.row, expand_x, at)
            if self.v.quant is not None:
                scale_bytes[at] = fmt.scale_bytes(buf, part.row)
            triples = torch.stack([part.src, fmt.tokens(buf)[part.row].long(), part.slot], dim=1)
            assist[: 3 * cap].view(-1, 3)[at] = triples.to(torch.int32)
            if self.weights:
                expand_scales[at] = fmt.weights(buf)[part.row, part.slot]
        return num_recv, counts

    @staticmethod
    def return_rows(assist: torch.Tensor, num_rows: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows ``[0, num_rows)`` of ``expand_x`` grouped by source rank (``assist_info_for_combine``'s triples),
        expert-major inside each source, and rows per source (none to masked sources)."""
        w, src = mask.numel(), assist[: 3 * num_rows : 3].long()
        if num_rows and (int(src.min()) < 0 or int(src.max()) >= w):
            raise shape(
                "assist_info_for_combine", "holds a source rank outside [0, W); pass dispatch's output unchanged"
            )
        order = torch.argsort(src, stable=True)
        per_src = torch.bincount(src, minlength=w)
        if bool(mask.any()):
            keep = mask.to(src.device)[src[order]] == 0
            order, per_src = order[keep], per_src.masked_fill(mask.to(src.device).bool(), 0)
        return order, per_src.tolist()


def add_wait_time(performance_info: torch.Tensor | None, agreement: Agreement, wait_ns: int) -> None:
    """Add this call's wait (µs: the agreement step plus the payload wait) to ``performance_info[src]`` for every
    source rank that sent this rank data (one collective serves all sources, so they share its wait time)."""
    if performance_info is None:
        return
    sent = torch.tensor([bool(any(c)) for c in agreement.counts], device=performance_info.device)
    performance_info += sent.to(torch.int64) * (agreement.wait_us + wait_ns // 1000)


def group_or_none(group: object, param: str) -> EPGroup | None:
    """The ops' EPGroup of ``group`` (a group or its name), or None when it names no group (nobody to tell)."""
    try:
        return ep_group(resolve_group(group, param))
    except MoeDistributeError:
        return None


def _validate(p: DispatchParams | CombineParams, ep: EPGroup | None, op: str, transport: Transport | None) -> Any:
    """``p.validate()``. A rank that rejects its input still takes part in the agreement step (EP over ``transport``,
    then TP) with the error's code, so the peers raise too instead of waiting; without a usable ``group_ep`` there is
    no one to tell."""
    try:
        return p.validate()
    except MoeDistributeError as err:
        if transport is None and (ep := ep or group_or_none(p.group_ep, "group_ep")) is not None:
            transport = Collective(ep)
        if transport is not None:
            transport.reject(op, err.code, *agreement_widths(op, transport.ep.num_ranks))
            tp = group_or_none(p.group_tp, "group_tp") if p.tp_world_size == 2 else None
            if tp is not None and tp.num_ranks == 2:
                tp_agree(tp, err.code, op)
        raise


def agreement_widths(op: str, num_ranks: int) -> tuple[int, int]:
    """The (counts per rank, shared values) of the flat ``op``'s agreement row (a dispatch op's name, or
    :data:`COMBINE_OP`): dispatch (rows, pairs) per rank + fingerprint and Bs; combine 2R counts + fingerprint."""
    d = op != COMBINE_OP
    return (2, len(Flat.names) + 1) if d else (0, 2 * num_ranks + len(COMBINE_NAMES))


def _plan(layout: EpLayout, ids: torch.Tensor, mask: torch.Tensor | None, ep: EPGroup, per_pair: bool) -> Plan:
    plain = layout.ep_rank_of == tuple(range(layout.world_size)) and not layout.shared_expert_rank_num
    if layout.active and plain and not layout.shared_expert_num and layout.num_local_experts:
        # routed experts only, EP rank = id // L: the masked layout's plan of the ids that are sent (the others -1)
        sent = (ids >= 0) & (ids < layout.num_moe_experts)
        if mask is not None:
            sent &= mask.unsqueeze(1) if mask.dim() == 1 else mask
        return plan_topk(torch.where(sent, ids, -1), num_local_experts=layout.num_local_experts,
                         num_ranks=layout.world_size, rank=layout.rank, mask=ep.mask,
                         per_pair_rows=per_pair)  # fmt: skip
    token, slot, dest, expert = routed_pairs(layout, ids, mask, ep.mask)
    return make_plan(
        token, slot, dest, expert, num_tokens=ids.shape[0], num_ranks=layout.world_size, rank=layout.rank,
        num_local_experts=max(layout.num_local_experts, 1), per_pair_rows=per_pair,
    )  # fmt: skip


def _pair_weights(plan: Plan, weights: torch.Tensor, topk: int, device: torch.device) -> torch.Tensor:
    """`[P]` fp32: ``weights[token, slot]`` of each pair, 1 for shared-expert copies (slot >= K)."""
    routed = plan.slot < topk
    out = torch.ones(plan.token.numel(), dtype=torch.float32, device=device)
    out[routed] = weights[plan.token[routed], plan.slot[routed]]
    return out


def start_dispatch_flat(p: DispatchParams, ep: EPGroup | None = None, workspace: Workspace | None = None,
                        transport: Transport | None = None) -> Completion:  # fmt: skip
    """Validate ``p`` and run the send phase; ``wait()`` returns the 7 outputs of ``npu_moe_distribute_dispatch_v2``
    (``ep``: the Buffer's group, default the ops' group of ``group_ep``; ``transport``: how rows move, a Buffer's,
    default the collective path)."""
    v: ValidDispatch = _validate(p, ep, p.op, transport)
    layout, x = v.layout, v.x
    ep = ep or ep_group(layout.group)
    per_pair = v.quant is not None and v.scales is not None
    plan = _plan(layout, v.ids, v.mask, ep, per_pair)
    weights = None if v.expert_scales is None else _pair_weights(plan, v.expert_scales, v.topk, x.device)
    fmt = RowFormat(x.shape[1], x.dtype, v.quant, v.topk + layout.shared_expert_num, weights is not None, False)
    flat = Flat(v, weights is not None)
    fingerprint = (
        layout.num_moe_experts, x.shape[1], v.topk, 0 if v.quant is None else v.quant.mode, v.global_bs_real,
        fmt.row_bytes, DTYPE_CODES[x.dtype], layout.shared_expert_num, layout.shared_expert_rank_num,
        hash(layout.ep_rank_of) & 0x7FFFFFFF, layout.tp_world_size, SCALAR_TYPE_CODE[fmt.data_dtype],
        OP_COMM_ALGS.index(p.comm_alg), x.shape[0],
    )  # fmt: skip
    smooth = _smooth(v, plan) if per_pair else None
    job = DispatchJob(ep, p.op, x, plan, fmt, weights, smooth, fingerprint, flat, workspace or Workspace(x.device))
    start = (transport or Collective(ep)).dispatch
    receive = with_tp_agreement(start, job, layout, x.dtype, v.quant is not None)
    return Completion(lambda: (receive.wait(), flat.outputs)[1])


def _smooth(v: ValidDispatch, plan: Plan) -> torch.Tensor:
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


def start_combine_flat(p: CombineParams, ep: EPGroup | None = None, workspace: Workspace | None = None,
                       transport: Transport | None = None) -> Completion:  # fmt: skip
    """Validate ``p`` and run the send phase; ``wait()`` returns ``x`` `[Bs, H]` of ``npu_moe_distribute_combine_v2``
    (TP: the ReduceScatterV over the pair runs after the agreement step, before the EP return; ``start``: as
    :func:`start_dispatch_flat`'s)."""
    v: ValidCombine = _validate(p, ep, COMBINE_OP, transport)
    layout, expand_x = v.layout, v.expand_x
    ep = ep or ep_group(layout.group)
    dev, num_tokens, hidden = expand_x.device, v.ids.shape[0], expand_x.shape[1]
    plan = _plan(layout, v.ids, v.mask, ep, True)
    weights = _pair_weights(plan, v.weights, v.topk, dev)
    return_rows, rows_per_src = Flat.return_rows(v.assist, v.num_rows, ep.mask)
    extra, addend, active = None, v.shared_x, None
    if v.mask is not None and v.mask.dim() == 1:
        active = int(v.mask.sum())  # only the active prefix is written (zero here; untouched on the NPU)
    if not layout.active:  # scaled out by elastic_info: takes no part, returns zeros
        addend, active = None, 0
    elif layout.copy_expert_num or layout.const_expert_num:
        extra = special_contributions(layout, v.ids, v.mask, v.weights, v.special)
    fmt = ReturnFormat(hidden, expand_x.dtype, v.comm_quant)
    fingerprint = (
        layout.num_moe_experts, hidden, DTYPE_CODES[expand_x.dtype], v.comm_quant, v.global_bs_real,
        layout.shared_expert_num, layout.shared_expert_rank_num, hash(layout.ep_rank_of) & 0x7FFFFFFF,
        layout.tp_world_size, OP_COMM_ALGS.index(p.comm_alg),
    )  # fmt: skip
    mismatch = ("assist_info_for_combine", "the expert_ids / x_active_mask used at dispatch and that dispatch's "
                "assist_info_for_combine and ep_recv_counts")  # fmt: skip
    out = torch.empty((num_tokens, hidden), dtype=expand_x.dtype, device=dev)
    job = CombineJob(
        ep, COMBINE_OP, expand_x, return_rows, rows_per_src, plan, weights, fmt, num_tokens, out, fingerprint,
        COMBINE_NAMES, mismatch, workspace or Workspace(dev), by_slot=True, extra=extra, addend=addend,
        active=active, on_wait=lambda agreement, wait_ns: add_wait_time(v.performance_info, agreement, wait_ns),
    )  # fmt: skip

    def reduce_scatter() -> bool:
        if layout.tp is None:
            return False
        job.source = tp_reduce_scatter(layout.tp, layout.tp_rank_id, expand_x, v.num_rows, v.num_peer)
        return True  # the rows to return changed: pack them again

    start = (transport or Collective(ep)).combine
    receive = with_tp_agreement(start, job, layout, expand_x.dtype, bool(v.comm_quant), reduce_scatter)
    return Completion(lambda: (receive.wait(), out)[1])


def special_contributions(
    layout: EpLayout, ids: torch.Tensor, mask: torch.Tensor | None, weights: torch.Tensor, tensors: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token `[n]`, slot `[n]`, value `[n, H]` fp32) of every active copy / const pair (ids ``moe_expert_num +
    [0, Z + C + Const)``, never sent: combine adds them locally; zero experts add nothing). ``ids`` `[Bs, K]`, ``mask``
    None / `[Bs]` / `[Bs, K]` bool, ``weights`` `[Bs, K]` fp32. Values follow the kernel (``CalConstExpertAlpha`` /
    ``ProcessConstantExpert``), as documented on :func:`deep_ep_npu.ops.moe_distribute_combine_v2`: each alpha row
    is reduced to one scalar per token (dot products over H in fp32), not applied elementwise."""
    ids, first_copy = ids.long(), layout.num_moe_experts + layout.zero_expert_num
    valid = ids >= first_copy
    if mask is not None:
        valid &= mask.unsqueeze(1) if mask.dim() == 1 else mask
    token, slot = valid.nonzero(as_tuple=True)
    keys = ("ori_x", "const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v")
    ori_x, alpha_1, alpha_2, v = (tensors[k] for k in keys)
    if token.numel() == 0 or ori_x is None:
        hidden = 0 if ori_x is None else ori_x.shape[1]
        return token, slot, torch.zeros((0, hidden), dtype=torch.float32, device=ids.device)
    ori = ori_x[token].float()
    value, c = ori.clone(), ids[token, slot] - first_copy - layout.copy_expert_num
    is_const = c >= 0
    if bool(is_const.any()) and alpha_1 is not None and alpha_2 is not None and v is not None:
        cc, o = c[is_const], ori[is_const]
        d1, d2 = (alpha_1[cc].float() * o).sum(dim=1), (alpha_2[cc].float() * o).sum(dim=1)
        m = torch.maximum(d1, d2)
        e1, e2 = torch.exp(d1 - m), torch.exp(d2 - m)
        value[is_const] = (e1 / (e1 + e2)).unsqueeze(1) * o + (e2 / (e1 + e2)).unsqueeze(1) * v[cc].float()
    return token, slot, weights[token, slot].unsqueeze(1) * value
