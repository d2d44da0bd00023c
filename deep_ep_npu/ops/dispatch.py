"""``moe_distribute_dispatch_v2`` over torch.distributed: the Ascend MoE distribute dispatch, flat layout.

Same keyword names, defaults, return order and output shapes as ``torch_npu.npu_moe_distribute_dispatch_v2``
(reference ascend_ops.md §2, §5), with A3 fullmesh semantics. Two extra keywords: ``ccl_buffer_size`` (MB the op may
use; shapes that do not fit are refused) and ``strict`` (also enforce the Atlas A3 hardware limits).

Wire protocol: a fixed-size header all-to-all (status, counts, parameter fingerprint), then one uneven
``all_to_all_single`` carrying each token once per destination rank (once per pair when smoothed int8 makes the
payload expert-specific) plus 16-20 bytes of metadata per (token, expert) pair; the receiver expands the rows.
"""

from __future__ import annotations

import dataclasses

import torch

from . import checks, comm
from .codec import Int8TokenCodec, PlainCodec, RowCodec
from .errors import MoeDistributeError, shape
from .group import abort_peers
from .layout import SendPlan, build_plan, expert_major_counts, logical_rank_of, receive_order
from .spec import EpLayout, check_ccl_buffer, reject_unsupported, validate_layout, validate_tokens
from .tp import raise_if_peer_failed, tp_agree_status, tp_allgather_rows

_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_FINGERPRINT = (
    "moe_expert_num",
    "hidden",
    "topk",
    "quant_mode",
    "global_bs",
    "row_bytes",
    "meta_ints",
    "x dtype",
    "shared_expert_num",
    "shared_expert_rank_num",
    "elastic_info",
    "tp_world_size",
)
_HEADER_WIDTH = len(_FINGERPRINT) + 1
META_TOKEN, META_SLOT, META_EXPERT, META_ROW, META_WEIGHT = range(5)


@dataclasses.dataclass
class _Prepared:
    layout: EpLayout
    x: torch.Tensor
    topk: int
    global_bs: int
    quant_mode: int
    codec: RowCodec
    plan: SendPlan
    meta: torch.Tensor
    scales: torch.Tensor | None
    expert_scales: torch.Tensor | None
    expert_token_nums_type: int
    performance_info: torch.Tensor | None


def _prepare(x, expert_ids, layout: EpLayout, kw: dict) -> _Prepared:
    x, ids, mask, topk, global_bs = validate_tokens(layout, "x", x, expert_ids, kw["x_active_mask"], kw["global_bs"])
    num_tokens, hidden = x.shape
    quant_mode = checks.one_of(kw["quant_mode"], "quant_mode", (0, 2), "A2/A3 support 0 (none) and 2 (per-token int8)")
    checks.one_of(kw["expert_token_nums_type"], "expert_token_nums_type", (0, 1))
    scales = checks.optional_tensor(kw["scales"], "scales", (torch.float32,), 2)
    if scales is not None:
        checks.dims(
            scales, "scales", (layout.shared_expert_num + layout.scales_experts, hidden), "(S + moe_expert_num, H)"
        )
    expert_scales = checks.optional_tensor(kw["expert_scales"], "expert_scales", (torch.float32,), 2)
    if expert_scales is not None:
        checks.dims(expert_scales, "expert_scales", (num_tokens, topk), "(Bs, K)")
    perf = checks.performance_info(kw["performance_info"], layout.world_size)
    reject_unsupported(y_dtype=kw["y_dtype"], x_dtype=kw["x_dtype"], scales_dtype=kw["scales_dtype"])
    check_ccl_buffer(layout, kw["ccl_buffer_size"], global_bs // layout.world_size, hidden, topk)

    codec: RowCodec = Int8TokenCodec(hidden) if quant_mode == 2 else PlainCodec(hidden, x.dtype)
    per_pair = quant_mode == 2 and scales is not None
    plan = build_plan(layout, ids, mask, per_pair)
    row_start = torch.tensor([0] + plan.rows_per_dest, dtype=torch.int64).cumsum(0)
    fields = [plan.token, plan.slot, plan.expert, plan.row_of_pair - row_start[plan.dest]]
    if expert_scales is not None:  # shared-expert copies (slot >= K) carry weight 1
        routed = plan.slot < topk
        weight = torch.ones(plan.num_pairs, dtype=torch.float32)
        weight[routed] = expert_scales[plan.token[routed], plan.slot[routed]]
        fields.append(weight.view(torch.int32).long())
    meta = (
        torch.stack(fields, dim=1).to(torch.int32)
        if plan.num_pairs
        else torch.empty((0, len(fields)), dtype=torch.int32)
    )
    return _Prepared(
        layout,
        x,
        topk,
        global_bs,
        quant_mode,
        codec,
        plan,
        meta,
        scales,
        expert_scales,
        kw["expert_token_nums_type"],
        perf,
    )


class DispatchHandle:
    """A dispatch whose send phase has started; :meth:`teardown` receives and returns the 7 outputs."""

    def __init__(self, prep: _Prepared, header: comm.Header, exchange: comm.PendingExchange) -> None:
        self._prep, self._header, self._exchange = prep, header, exchange
        self._outputs: tuple[torch.Tensor, ...] | None = None

    def teardown(self) -> tuple[torch.Tensor, ...]:
        """Wait for the payload and build ``(expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums,
        ep_recv_counts, tp_recv_counts, expand_scales)``. Idempotent."""
        if self._outputs is None:
            recv = self._exchange.wait()
            comm.add_wait_time(self._prep.performance_info, self._header, self._exchange.wait_us)
            self._outputs = _finish(self._prep, self._header, recv)
        return self._outputs


def _finish(prep: _Prepared, header: comm.Header, recv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    layout, hidden, topk = prep.layout, prep.x.shape[1], prep.topk
    w, num_local = layout.world_size, layout.num_local_experts_here
    capacity = layout.recv_capacity(prep.global_bs, topk)
    meta_ints = prep.meta.shape[1]
    meta, src, row_base = comm.unpack_meta(recv, header.rows, header.pairs, meta_ints)
    expert = meta[:, META_EXPERT].long()
    order = receive_order(expert, src, w)
    num_recv = int(order.numel())
    if num_recv > capacity:
        raise shape(
            "expert_ids", f"this rank received {num_recv} rows but can hold A = {capacity}; inconsistent inputs"
        )
    rows = recv[(row_base + meta[:, META_ROW].long())[order]]
    counts = expert_major_counts(expert, src, num_local, w).reshape(-1)
    all_counts = counts
    tp = max(layout.tp_world_size, 1)
    tp_recv_counts = torch.full((layout.tp_world_size,), num_recv, dtype=torch.int32)
    if layout.tp_group is not None:  # own rows first, then the TP peer's
        peer_rows, peer_counts = tp_allgather_rows(layout.tp_group, layout.tp_rank_id, rows, counts)
        tp_recv_counts[1 - layout.tp_rank_id] = peer_rows.shape[0]
        rows = torch.cat([rows, peer_rows])
        all_counts = torch.cat([counts, peer_counts])
    num_rows = rows.shape[0]

    out_dtype = torch.int8 if prep.quant_mode == 2 else prep.x.dtype
    expand_x = torch.zeros((capacity * tp, hidden), dtype=out_dtype)
    if prep.quant_mode == 2:
        dynamic_scales = torch.zeros((capacity * tp,), dtype=torch.float32)
        prep.codec.decode_into(rows, expand_x[:num_rows], dynamic_scales[:num_rows].unsqueeze(1))
    else:
        prep.codec.decode_into(rows, expand_x[:num_rows], None)
        width = () if prep.scales is None else (prep.scales.shape[1],)
        dynamic_scales = torch.zeros((capacity * tp, *width), dtype=torch.float32)

    assist = torch.zeros((max(prep.x.shape[0] * topk, capacity * 128),), dtype=torch.int32)
    triples = torch.stack([src, meta[:, META_TOKEN].long(), meta[:, META_SLOT].long()], dim=1)[order]
    assist[: 3 * num_recv] = triples.reshape(-1).to(torch.int32)

    per_expert = all_counts.view(tp, num_local, w).sum(dim=(0, 2))
    expert_token_nums = (per_expert.cumsum(0) if prep.expert_token_nums_type == 0 else per_expert).to(torch.int64)
    extra = 2 * prep.global_bs * topk * (w // 8) if prep.expert_scales is not None else 0
    ep_recv_counts = torch.zeros((all_counts.numel() + extra,), dtype=torch.int32)
    ep_recv_counts[: all_counts.numel()] = all_counts.cumsum(0).to(torch.int32)
    if prep.expert_scales is not None:
        expand_scales = torch.zeros((capacity,), dtype=torch.float32)
        expand_scales[:num_recv] = meta[order, META_WEIGHT].view(torch.float32)
    else:
        expand_scales = torch.empty((0,), dtype=torch.float32)
    return expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales


def moe_distribute_dispatch_setup(
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    y_dtype=None,
    x_dtype=None,
    scales_dtype=None,
    ccl_buffer_size=None,
    strict=False,
) -> DispatchHandle:
    """The send phase of :func:`moe_distribute_dispatch_v2` (the seeds' DispatchSetup): validates, exchanges the
    header, and starts the payload all-to-all asynchronously. Compute placed before ``teardown()`` overlaps it."""
    try:
        layout = validate_layout(
            group_ep,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            tp_world_size=tp_world_size,
            tp_rank_id=tp_rank_id,
            expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            comm_alg=comm_alg,
            zero_expert_num=zero_expert_num,
            copy_expert_num=copy_expert_num,
            const_expert_num=const_expert_num,
            strict=strict,
            group_tp=group_tp,
            elastic_info=elastic_info,
        )
    except MoeDistributeError as err:
        abort_peers(group_ep, group_tp, tp_world_size, _HEADER_WIDTH, err)
        raise
    kw = dict(
        scales=scales,
        x_active_mask=x_active_mask,
        expert_scales=expert_scales,
        performance_info=performance_info,
        quant_mode=quant_mode,
        global_bs=global_bs,
        expert_token_nums_type=expert_token_nums_type,
        y_dtype=y_dtype,
        x_dtype=x_dtype,
        scales_dtype=scales_dtype,
        ccl_buffer_size=ccl_buffer_size,
    )
    w = layout.world_size
    try:
        prep = _prepare(x, expert_ids, layout, kw)
    except MoeDistributeError as err:
        comm.exchange_header(layout.group, w, err.code, [0] * w, [0] * w, [0] * _HEADER_WIDTH)
        tp_agree_status(layout.tp_group, err.code)
        raise
    plan = prep.plan
    fingerprint = (
        layout.num_moe_experts,
        prep.x.shape[1],
        prep.topk,
        prep.quant_mode,
        prep.global_bs,
        prep.codec.row_bytes,
        prep.meta.shape[1],
        _DTYPE_CODES[prep.x.dtype],
        layout.shared_expert_num,
        layout.shared_expert_rank_num,
        hash(layout.ep_rank_of) & 0x7FFFFFFF,
        layout.tp_world_size,
    )
    header = comm.exchange_header(
        layout.group, w, comm.STATUS_OK, plan.rows_per_dest, plan.pairs_per_dest, (*fingerprint, prep.x.shape[0])
    )
    try:
        _check_dispatch_header(header, layout, global_bs)
    except MoeDistributeError as err:
        tp_agree_status(layout.tp_group, err.code)
        raise
    tp_print = (
        prep.x.shape[1],
        _DTYPE_CODES[prep.x.dtype] * 4 + prep.quant_mode,
        prep.codec.row_bytes,
        layout.num_moe_experts,
    )
    raise_if_peer_failed(layout.tp_group, comm.STATUS_OK, "moe_distribute_dispatch_v2", tp_print)
    rows = _encode_rows(prep)
    send, send_units = comm.pack_payload(rows, plan.rows_per_dest, prep.meta, plan.pairs_per_dest)
    recv_units = [
        comm.meta_units(p, prep.meta.shape[1] * 4, prep.codec.row_bytes) + r
        for r, p in zip(header.rows, header.pairs, strict=True)
    ]
    return DispatchHandle(prep, header, comm.PendingExchange(layout.group, send, send_units, recv_units))


def _check_dispatch_header(header: comm.Header, layout: EpLayout, global_bs: int) -> None:
    comm.check_header(header, layout.rank, (), "moe_distribute_dispatch_v2")
    batch = [fp[-1] for fp in header.fingerprint]
    if global_bs == 0 and len(set(batch)) > 1:
        raise shape(
            "global_bs",
            f"is 0 but x has different batch sizes across ranks (per rank: {batch}); pass global_bs = max(Bs) * W",
        )
    header.fingerprint = [fp[:-1] for fp in header.fingerprint]
    comm.check_header(header, layout.rank, _FINGERPRINT, "moe_distribute_dispatch_v2")


def _encode_rows(prep: _Prepared) -> torch.Tensor:
    plan, layout = prep.plan, prep.layout
    smooth = None
    if prep.scales is not None and prep.quant_mode == 2:  # row S + e for routed expert e, row s for shared s
        logical = logical_rank_of(layout)[plan.dest]
        global_expert = (logical - layout.shared_expert_rank_num) * layout.num_local_experts + plan.expert
        row = torch.where(plan.slot >= prep.topk, plan.slot - prep.topk, layout.shared_expert_num + global_expert)
        smooth = prep.scales[row]
    return prep.codec.encode(prep.x[plan.row_token], smooth)
