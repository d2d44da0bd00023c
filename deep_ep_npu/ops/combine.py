"""``moe_distribute_combine_v2`` over torch.distributed: return expert outputs and reduce them at the source rank.

Same keyword names, defaults and output as ``torch_npu.npu_moe_distribute_combine_v2`` (ascend_ops.md §3, §5).
The expert rank sends each received row back to its source rank, grouped by source; the source rank knows from
``expert_ids`` (and the mask) exactly which rows come back in which order, so only rows travel. A fixed-size header
first carries every rank's status and its full send/expect vectors, so inputs that do not match the dispatch are
reported on every rank instead of hanging the all-to-all.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import checks, comm
from .codec import Int8GroupCodec, PlainCodec, RowCodec
from .dispatch import _DTYPE_CODES
from .errors import MoeDistributeError, invalid, shape
from .group import abort_peers, resolve_group
from .layout import SendPlan, build_plan
from .spec import EpLayout, validate_layout, validate_tokens
from .special import special_contributions, validate_special
from .tp import raise_if_peer_failed, tp_agree_status, tp_reduce_scatter

_FINGERPRINT = (
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


@dataclasses.dataclass
class _Prepared:
    layout: EpLayout
    num_tokens: int
    hidden: int
    topk: int
    out_dtype: torch.dtype
    plan: SendPlan
    ids: torch.Tensor
    expert_scales: torch.Tensor
    shared_expert_x: torch.Tensor | None
    x_active_mask: torch.Tensor | None
    special: dict
    performance_info: torch.Tensor | None
    rows: torch.Tensor  # `[num_rows, H]` expert outputs to return (after the TP reduce-scatter), in src order
    rows_per_src: list[int]
    num_own_rows: int
    num_peer_rows: int
    codec: RowCodec


def _prepare(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, layout: EpLayout, kw: dict):
    strict = layout.strict
    expand_x = checks.tensor(
        expand_x,
        "expand_x",
        (torch.bfloat16, torch.float16) if strict else (torch.bfloat16, torch.float16, torch.float32),
        2,
    )
    hidden = expand_x.shape[1]
    # the tokens' own checks reuse dispatch's rules, with x's shape taken from expert_ids and expand_x
    ids_probe = checks.tensor(expert_ids, "expert_ids", (torch.int32, torch.int64), 2)
    fake_x = expand_x.new_empty((ids_probe.shape[0], hidden))
    _, ids, mask, topk, global_bs = validate_tokens(
        layout, "expand_x", fake_x, ids_probe, kw["x_active_mask"], kw["global_bs"]
    )
    num_tokens = ids.shape[0]
    assist = checks.tensor(assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
    counts = checks.tensor(ep_send_counts, "ep_send_counts", (torch.int32,), 1)
    weights = checks.tensor(expert_scales, "expert_scales", (torch.float32,), 2)
    checks.dims(weights, "expert_scales", (num_tokens, topk), "(Bs, K)")
    shared_x = checks.optional_tensor(kw["shared_expert_x"], "shared_expert_x", (expand_x.dtype,), (2, 3))
    if shared_x is not None:
        if layout.shared_expert_rank_num:
            raise shape("shared_expert_x", "is only allowed when shared_expert_rank_num == 0")
        if shared_x.dim() == 3:
            if shared_x.shape[0] * shared_x.shape[1] != num_tokens or shared_x.shape[2] != hidden:
                raise shape("shared_expert_x", f"3D shape {tuple(shared_x.shape)} must be (a, b, H) with a*b = Bs")
            shared_x = shared_x.reshape(num_tokens, hidden)
        checks.dims(shared_x, "shared_expert_x", (num_tokens, hidden), "(Bs, H)")
    comm_quant = checks.one_of(kw["comm_quant_mode"], "comm_quant_mode", (0, 2), "0 none, 2 int8 with 8-element scales")
    if comm_quant == 2 and layout.tp_world_size == 2:
        raise invalid("comm_quant_mode", "2 (int8 comm quant) is not supported with tp_world_size 2")
    if comm_quant == 2 and hidden % 8:
        raise shape("expand_x", f"hidden {hidden} must be a multiple of 8 for comm_quant_mode 2")
    special = validate_special(layout, num_tokens, hidden, expand_x.dtype, kw)
    perf = checks.performance_info(kw["performance_info"], layout.world_size)

    w, num_local = layout.world_size, layout.num_local_experts_here
    tp = max(layout.tp_world_size, 1)
    if counts.numel() < w * num_local * tp:
        raise shape(
            "ep_send_counts",
            f"has {counts.numel()} entries, needs W * L{' * 2' if tp == 2 else ''} = {w * num_local * tp}",
        )
    num_rows = int(counts[w * num_local - 1])
    num_peer = 0
    if layout.tp_world_size == 2:
        tp_counts = checks.tensor(kw["tp_send_counts"], "tp_send_counts", (torch.int32,), 1)
        checks.dims(tp_counts, "tp_send_counts", (2,), "(tp_world_size,)")
        num_peer = int(counts[2 * w * num_local - 1]) - num_rows
        if int(tp_counts[layout.tp_rank_id]) != num_rows or int(tp_counts[1 - layout.tp_rank_id]) != num_peer:
            raise shape(
                "tp_send_counts",
                f"{tp_counts.tolist()} does not match ep_send_counts ({num_rows} own rows, "
                f"{num_peer} peer rows); pass dispatch's tp_recv_counts unchanged",
            )
    capacity = layout.recv_capacity(global_bs, topk)
    if not (0 <= num_rows <= capacity and 0 <= num_peer <= capacity and num_rows + num_peer <= expand_x.shape[0]):
        raise shape(
            "ep_send_counts",
            f"total {num_rows} rows (+{num_peer} TP peer rows), but expand_x has "
            f"{expand_x.shape[0]} and A = {capacity}",
        )
    if assist.numel() < 3 * num_rows:
        raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs 3 * {num_rows}")
    src = assist[: 3 * num_rows : 3].long()
    if num_rows and (int(src.min()) < 0 or int(src.max()) >= w):
        raise shape("assist_info_for_combine", "holds a source rank outside [0, W); pass dispatch's output unchanged")
    codec = Int8GroupCodec(hidden, expand_x.dtype) if comm_quant == 2 else PlainCodec(hidden, expand_x.dtype)
    plan = build_plan(layout, ids, mask, per_pair_rows=True)
    return (
        _Prepared(
            layout,
            num_tokens,
            hidden,
            topk,
            expand_x.dtype,
            plan,
            ids,
            weights,
            shared_x,
            mask,
            special,
            perf,
            expand_x,
            torch.bincount(src, minlength=w).tolist(),
            num_rows,
            num_peer,
            codec,
        ),
        global_bs,
        src,
    )


class CombineHandle:
    """A combine whose send phase has started; :meth:`teardown` receives and returns ``x`` `[Bs, H]`."""

    def __init__(self, prep: _Prepared, header: comm.Header, exchange: comm.PendingExchange) -> None:
        self._prep, self._header, self._exchange = prep, header, exchange
        self._out: torch.Tensor | None = None

    def teardown(self) -> torch.Tensor:
        """Wait for the returned rows and apply the weighted sum. Idempotent."""
        if self._out is None:
            recv = self._exchange.wait()
            comm.add_wait_time(self._prep.performance_info, self._header, self._exchange.wait_us)
            self._out = _finish(self._prep, recv)
        return self._out


def _finish(prep: _Prepared, recv: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k c[t, k]`` over slots k ascending (routed: ``w * y``; shared slots ``K + s``: ``y``;
    copy / const experts: see :mod:`.special`), in fp32; then ``shared_expert_x[t]``; one round-to-nearest-even cast.
    """
    plan, layout = prep.plan, prep.layout
    acc = torch.zeros((prep.num_tokens, prep.hidden), dtype=torch.float32)
    if not layout.active:
        return acc.to(prep.out_dtype)  # scaled out by elastic_info: takes no part
    y = prep.codec.decode_float(recv)
    routed = plan.slot < prep.topk
    weight = torch.ones(plan.num_pairs, dtype=torch.float32)
    weight[routed] = prep.expert_scales[plan.token[routed], plan.slot[routed]]
    tokens, slots, values = [plan.token], [plan.slot], [y * weight.unsqueeze(1)]
    if layout.copy_expert_num or layout.const_expert_num:
        valid = _active_pairs(prep)
        t, k, v = special_contributions(layout, prep.ids, valid, prep.expert_scales, prep.special)
        tokens.append(t)
        slots.append(k)
        values.append(v)
    token, slot, value = torch.cat(tokens), torch.cat(slots), torch.cat(values)
    for k in torch.unique(slot).tolist():
        sel = (slot == k).nonzero(as_tuple=True)[0]
        acc.index_add_(0, token[sel], value[sel])
    if prep.shared_expert_x is not None:
        acc += prep.shared_expert_x.float()
    mask = prep.x_active_mask
    if mask is not None and mask.dim() == 1:
        acc[int(mask.sum()) :] = 0.0  # only the active prefix is written (zero here; untouched on the NPU)
    return acc.to(prep.out_dtype)


def _active_pairs(prep: _Prepared) -> torch.Tensor:
    """`[Bs, K]` bool: the pairs the mask keeps."""
    mask = prep.x_active_mask
    valid = torch.ones(prep.ids.shape, dtype=torch.bool)
    if mask is not None:
        valid &= mask.unsqueeze(1) if mask.dim() == 1 else mask
    return valid


def moe_distribute_combine_setup(
    expand_x,
    expert_ids,
    assist_info_for_combine,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    comm_quant_mode=0,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    strict=False,
) -> CombineHandle:
    """The send phase of :func:`moe_distribute_combine_v2` (the seeds' CombineSetup): validates, exchanges the
    header, runs the TP reduce-scatter (tp_world_size 2) and starts the EP return asynchronously."""
    width = 2 * dist.get_world_size(resolve_group(group_ep, "group_ep")) + len(_FINGERPRINT)
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
        abort_peers(group_ep, group_tp, tp_world_size, width, err)
        raise
    kw = dict(
        tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask,
        shared_expert_x=shared_expert_x,
        ori_x=ori_x,
        const_expert_alpha_1=const_expert_alpha_1,
        const_expert_alpha_2=const_expert_alpha_2,
        const_expert_v=const_expert_v,
        performance_info=performance_info,
        global_bs=global_bs,
        comm_quant_mode=comm_quant_mode,
    )
    w = layout.world_size
    try:
        prep, global_bs_real, src = _prepare(
            expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, layout, kw
        )
    except MoeDistributeError as err:
        comm.exchange_header(layout.group, w, err.code, [0] * w, [0] * w, [0] * width)
        tp_agree_status(layout.tp_group, err.code)
        raise
    del expand_scales  # A3 fullmesh applies expert_scales at the source; expand_scales is informational
    fingerprint = (
        *prep.rows_per_src,
        *prep.plan.pairs_per_dest,
        layout.num_moe_experts,
        prep.hidden,
        _DTYPE_CODES[prep.out_dtype],
        comm_quant_mode,
        global_bs_real,
        layout.shared_expert_num,
        layout.shared_expert_rank_num,
        hash(layout.ep_rank_of) & 0x7FFFFFFF,
        layout.tp_world_size,
    )
    header = comm.exchange_header(
        layout.group, w, comm.STATUS_OK, prep.rows_per_src, prep.plan.pairs_per_dest, fingerprint
    )
    try:
        _check_combine_header(header, layout)
    except MoeDistributeError as err:
        tp_agree_status(layout.tp_group, err.code)
        raise
    tp_print = (
        prep.hidden,
        _DTYPE_CODES[prep.out_dtype] * 4 + comm_quant_mode,
        prep.codec.row_bytes,
        layout.num_moe_experts,
    )
    raise_if_peer_failed(layout.tp_group, comm.STATUS_OK, "moe_distribute_combine_v2", tp_print)
    rows = prep.rows
    if layout.tp_group is not None:
        rows = tp_reduce_scatter(layout.tp_group, layout.tp_rank_id, rows, prep.num_own_rows, prep.num_peer_rows)
    order = torch.argsort(src, stable=True)
    send_rows = prep.codec.encode(rows[: prep.num_own_rows][order])
    prep.rows = None  # type: ignore[assignment]  # only the encoded copy is needed now
    exchange = comm.PendingExchange(layout.group, send_rows, prep.rows_per_src, prep.plan.pairs_per_dest)
    return CombineHandle(prep, header, exchange)


def _check_combine_header(header: comm.Header, layout: EpLayout) -> None:
    w = layout.world_size
    comm.check_header(header, layout.rank, (), "moe_distribute_combine_v2")
    sends = [fp[:w] for fp in header.fingerprint]  # sends[p][q]: rows rank p returns to rank q
    expects = [fp[w : 2 * w] for fp in header.fingerprint]  # expects[q][p]: pairs rank q dispatched to rank p
    bad = [(p, q) for p in range(w) for q in range(w) if sends[p][q] != expects[q][p]]
    if bad:
        p, q = bad[0]
        raise shape(
            "assist_info_for_combine",
            f"rank {p} would return {sends[p][q]} rows to rank {q}, which dispatched {expects[q][p]} pairs to it; pass "
            "the expert_ids / x_active_mask used at dispatch and that dispatch's assist_info_for_combine and "
            f"ep_recv_counts (mismatched rank pairs: {bad[:8]})",
        )
    header.fingerprint = [fp[2 * w :] for fp in header.fingerprint]
    comm.check_header(header, layout.rank, _FINGERPRINT, "moe_distribute_combine_v2")
