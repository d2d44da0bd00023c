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

from . import checks, comm
from .codec import PlainCodec, RowCodec
from .dispatch import _DTYPE_CODES, build_plan
from .errors import MoeDistributeError, shape
from .layout import SendPlan
from .spec import EpLayout, reject_unsupported, validate_layout, validate_tokens

_FINGERPRINT = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "global_bs")


@dataclasses.dataclass
class _Prepared:
    layout: EpLayout
    num_tokens: int
    hidden: int
    out_dtype: torch.dtype
    plan: SendPlan
    expert_scales: torch.Tensor
    shared_expert_x: torch.Tensor | None
    x_active_mask: torch.Tensor | None
    send_rows: torch.Tensor
    rows_per_src: list[int]
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
    checks.one_of(kw["comm_quant_mode"], "comm_quant_mode", (0,), "int8 comm quant is not implemented yet")
    reject_unsupported(
        tp_send_counts=kw["tp_send_counts"],
        elastic_info=kw["elastic_info"],
        ori_x=kw["ori_x"],
        const_expert_alpha_1=kw["const_expert_alpha_1"],
        const_expert_alpha_2=kw["const_expert_alpha_2"],
        const_expert_v=kw["const_expert_v"],
        performance_info=kw["performance_info"],
    )
    if layout.copy_expert_num or layout.const_expert_num:
        raise MoeDistributeError(161002, "copy_expert_num", "copy/const experts are not implemented yet")

    w, num_local = layout.world_size, layout.num_local_experts_here
    if counts.numel() < w * num_local:
        raise shape("ep_send_counts", f"has {counts.numel()} entries, needs W * L = {w * num_local}")
    num_rows = int(counts[w * num_local - 1]) if w * num_local else 0
    capacity = layout.recv_capacity(global_bs, topk)
    if not 0 <= num_rows <= min(capacity, expand_x.shape[0]):
        raise shape("ep_send_counts", f"total {num_rows} rows, but expand_x has {expand_x.shape[0]} and A = {capacity}")
    if assist.numel() < 3 * num_rows:
        raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs 3 * {num_rows}")
    src = assist[: 3 * num_rows : 3].long()
    if num_rows and (int(src.min()) < 0 or int(src.max()) >= w):
        raise shape("assist_info_for_combine", "holds a source rank outside [0, W); pass dispatch's output unchanged")
    order = torch.argsort(src, stable=True)
    codec = PlainCodec(hidden, expand_x.dtype)
    send_rows = codec.encode(expand_x[:num_rows][order])
    rows_per_src = torch.bincount(src, minlength=w).tolist()
    plan = build_plan(layout, ids, mask, per_pair_rows=True)
    return _Prepared(
        layout, num_tokens, hidden, expand_x.dtype, plan, weights, shared_x, mask, send_rows, rows_per_src, codec
    ), global_bs


class CombineHandle:
    """A combine whose send phase has started; :meth:`teardown` receives and returns ``x`` `[Bs, H]`."""

    def __init__(self, prep: _Prepared, exchange: comm.PendingExchange) -> None:
        self._prep, self._exchange = prep, exchange
        self._out: torch.Tensor | None = None

    def teardown(self) -> torch.Tensor:
        """Wait for the returned rows and apply the weighted sum. Idempotent."""
        if self._out is None:
            self._out = _finish(self._prep, self._exchange.wait())
        return self._out


def _finish(prep: _Prepared, recv: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * y[t,k]`` over the returned pairs, k ascending, in fp32; then ``shared_expert_x[t]``;
    one final round-to-nearest-even cast."""
    plan = prep.plan
    y = recv[:, : prep.codec.data_bytes].view(prep.out_dtype).float()
    acc = torch.zeros((prep.num_tokens, prep.hidden), dtype=torch.float32)
    if plan.num_pairs:
        weight = prep.expert_scales[plan.token, plan.slot]
        for k in torch.unique(plan.slot).tolist():
            sel = (plan.slot == k).nonzero(as_tuple=True)[0]
            acc.index_add_(0, plan.token[sel], y[sel] * weight[sel].unsqueeze(1))
    if prep.shared_expert_x is not None:
        acc += prep.shared_expert_x.float()
    mask = prep.x_active_mask
    if mask is not None and mask.dim() == 1:
        acc[int(mask.sum()) :] = 0.0  # only the active prefix is written (zero here; untouched on the NPU)
    return acc.to(prep.out_dtype)


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
    """The send phase of :func:`moe_distribute_combine_v2` (the seeds' CombineSetup); ``teardown()`` finishes it."""
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
    )
    kw = dict(
        tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask,
        shared_expert_x=shared_expert_x,
        elastic_info=elastic_info,
        ori_x=ori_x,
        const_expert_alpha_1=const_expert_alpha_1,
        const_expert_alpha_2=const_expert_alpha_2,
        const_expert_v=const_expert_v,
        performance_info=performance_info,
        global_bs=global_bs,
        comm_quant_mode=comm_quant_mode,
    )
    w = layout.world_size
    width = 2 * w + len(_FINGERPRINT)
    try:
        prep, global_bs_real = _prepare(
            expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, layout, kw
        )
    except MoeDistributeError as err:
        comm.exchange_header(layout.group, w, err.code, [0] * w, [0] * w, [0] * width)
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
    )
    header = comm.exchange_header(
        layout.group, w, comm.STATUS_OK, prep.rows_per_src, prep.plan.pairs_per_dest, fingerprint
    )
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
    exchange = comm.PendingExchange(layout.group, prep.send_rows, prep.rows_per_src, prep.plan.pairs_per_dest)
    return CombineHandle(prep, exchange)


def moe_distribute_combine_v2(
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
) -> torch.Tensor:
    """Return expert outputs to their source ranks and reduce them there (Ascend MoE distribute combine).

    Arguments:
        expand_x: `[A, H]` with `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert outputs, row-aligned
            with dispatch's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32`, x_active_mask `[Bs]` / `[Bs, K]` bool, global_bs: as given to dispatch.
        assist_info_for_combine: dispatch's `torch.int32` output, unchanged.
        ep_send_counts: dispatch's ``ep_recv_counts`` (`[W * L]` `torch.int32`), unchanged.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights, applied at the source rank.
        shared_expert_x: `[Bs, H]` (or `[a, b, H]` with a * b = Bs), expand_x's dtype: added with weight 1.
        expand_scales: accepted for signature compatibility; unused (A3 fullmesh weights at the source).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k expert_scales[t,k] * y[t,k]`` (k ascending, fp32) plus
        ``shared_expert_x[t]``, then one round-to-nearest-even cast. Masked or non-routed pairs contribute nothing;
        tokens outside a 1D mask's prefix are zero.

    Raises:
        MoeDistributeError: invalid input, or inputs that do not match the dispatch (on every rank).
    """
    return moe_distribute_combine_setup(
        expand_x,
        expert_ids,
        assist_info_for_combine,
        ep_send_counts,
        expert_scales,
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask,
        expand_scales=expand_scales,
        shared_expert_x=shared_expert_x,
        elastic_info=elastic_info,
        ori_x=ori_x,
        const_expert_alpha_1=const_expert_alpha_1,
        const_expert_alpha_2=const_expert_alpha_2,
        const_expert_v=const_expert_v,
        performance_info=performance_info,
        group_tp=group_tp,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs,
        comm_quant_mode=comm_quant_mode,
        comm_alg=comm_alg,
        zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num,
        const_expert_num=const_expert_num,
        strict=strict,
    ).teardown()
