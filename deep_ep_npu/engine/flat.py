"""Ascend's flat layout (the MoE distribute ops: ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``, the Buffer's
flat methods, MegaMoE's pipeline): ``expand_x`` `[A, H]` expert-major, then source rank, then source token, with
shared-expert ranks, zero / copy / const experts (never sent: combine adds them at the source), elastic re-layout,
per-token quantization with smooth scales, and the TP stage (:mod:`.tp`: the TP peer's rows follow this rank's own).
Combine returns each row to its source (``assist_info_for_combine``'s triples) and sums there per token, slots
ascending, in fp32, then ``shared_expert_x``."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .. import kernels
from ..core import ascend
from ..core.ascend import OP_COMM_ALGS
from ..core.call import Experts, FlatCombine, FlatDispatch
from ..core.platforms import SCALAR_TYPE_CODE
from ..core.rules import values_checked
from ..errors import shape
from ..transports import static
from ..transports.agreement import STATUS_OK, Agreement
from .plan import pair_weights, plan_call, smooth_rows
from .reduce import CombineJob, special_contributions
from .rows import DTYPE_CODES, Parts, RowFormat, parse, row_format
from .tp import tp_agree, tp_gather_rows, tp_reduce_scatter

NAMES = ("moe_expert_num", "hidden", "topk", "quant_mode", "global_bs", "row_bytes", "x dtype", "shared_expert_num",
         "shared_expert_rank_num", "elastic_info", "tp_world_size", "y_dtype", "comm_alg")  # fmt: skip
COMBINE_NAMES = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "global_bs", "shared_expert_num",
                 "shared_expert_rank_num", "elastic_info", "tp_world_size", "comm_alg")  # fmt: skip
MISMATCH = ("assist_info_for_combine", "the expert_ids / x_active_mask used at dispatch and that dispatch's "
            "assist_info_for_combine and ep_recv_counts")  # fmt: skip


class _Flat:
    """The layout of one flat dispatch (the :class:`.Layout` protocol). :meth:`result` is the 7 outputs of
    :func:`deep_ep_npu.ops.moe_distribute_dispatch_v2`, allocated here, filled by :meth:`place`."""

    known, vectors, agree_now, names = None, (), True, NAMES

    def __init__(self, c: FlatDispatch, engine: Any) -> None:
        e, x, q = c.experts, c.x, c.quant
        self.c, self.ep, self.source, dev = c, engine.ep, x, x.device
        scales = c.scales if q is not None else None
        self.plan = plan = plan_call(e, c.expert_ids, c.x_active_mask, engine.mask, scales is not None)
        self.weights = None if c.expert_scales is None else pair_weights(plan, c.expert_scales, c.expert_ids.shape[1])
        self.smooth = None if scales is None else smooth_rows(e, plan, scales, c.expert_ids.shape[1])
        topk, hidden, tp, cap = c.expert_ids.shape[1], x.shape[1], 1 if e.tp is None else 2, c.capacity
        self.fmt = fmt = row_format(hidden, x.dtype, q, topk + e.shared_expert_num, self.weights is not None)
        self.fingerprint = fingerprint(c, fmt)
        width, scale_dtype = ((), torch.float32) if q is None else (q.scale_shape(hidden), q.scale_dtype)
        if q is None and c.scales is not None and c.scales.shape[1]:  # quant_mode 0 given scales: `[A, H]` zeros
            width = (c.scales.shape[1],)
        self.expand_x = torch.empty((cap * tp, hidden), dtype=fmt.data_dtype, device=dev)
        scale_row = math.prod(width) * scale_dtype.itemsize
        self.scale_bytes = torch.empty((cap * tp, scale_row), dtype=torch.uint8, device=dev)
        self.dynamic_scales = self.scale_bytes.view(scale_dtype).view(cap * tp, *width)
        self.assist = torch.empty((max(x.shape[0] * topk, cap * 128),), dtype=torch.int32, device=dev)
        self.expand_scales = torch.empty((cap if self.weights is not None else 0,), dtype=torch.float32, device=dev)
        self.token_nums = torch.empty((e.num_local_here,), dtype=torch.int64, device=dev)
        extra = 2 * c.global_bs * topk * (e.world_size // 8) if self.weights is not None and e.platform != "a5" else 0
        self.recv_counts = torch.zeros((e.world_size * e.num_local_here * tp + extra,), dtype=torch.int32, device=dev)
        self.tp_recv_counts = torch.empty((e.tp_world_size,), dtype=torch.int32, device=dev)
        self.tp = None if e.tp is None else TPStage(e, c.op, x, q is not None, fmt.row_bytes)

    def result(self) -> tuple[torch.Tensor, ...]:
        return (
            self.expand_x,
            self.dynamic_scales,
            self.assist,
            self.token_nums,
            self.recv_counts,
            self.tp_recv_counts,
            self.expand_scales,
        )

    def check(self, agreement: Agreement) -> None:
        check_batch(self.c, self.ep, agreement)

    def place(self, parts: Parts, own: tuple[int, torch.Tensor], agreement: Agreement, wait_ns: int) -> None:
        c, e, fmt, cap = self.c, self.c.experts, self.fmt, self.c.capacity
        w, num_local = e.world_size, e.num_local_here
        counts = torch.zeros((num_local, w), dtype=torch.int64, device=self.source.device)
        carried = 0 if c.quant is None else fmt.scale_end - fmt.scale_off  # scale bytes per row that travel
        blocks = [*parts, own]
        expand_x, scale_bytes = self.expand_x, self.scale_bytes
        num_recv = kernels.place_flat(
            blocks,
            fmt,
            carried,
            self.weights is not None,
            counts,
            expand_x[:cap],
            scale_bytes[:cap],
            self.assist,
            self.expand_scales,
        )
        if num_recv is None:
            num_recv = self._place_torch(blocks, counts)
        elif num_recv < 0:
            num_recv = int(counts.sum())
        if num_recv > cap:
            raise shape("expert_ids", f"this rank received {num_recv} rows but can hold A = {cap}")
        for t, rows_used in ((expand_x, num_recv), (scale_bytes, carried and num_recv), (self.assist, 3 * num_recv)):
            t[rows_used:] = 0  # (the rows past the received ones read as zeros; scales that do not travel, all)
        self.expand_scales[num_recv:] = 0
        all_counts = counts.reshape(-1)
        self.tp_recv_counts.fill_(num_recv)
        if e.tp is not None:  # append the TP peer's received rows and counts
            all_counts, self.tp_recv_counts[1 - e.tp_rank_id] = tp_gather_rows(
                e.tp, e.tp_rank_id, expand_x, self.dynamic_scales, num_recv, all_counts
            )
        per_expert = all_counts.view(-1, num_local, w).sum(dim=(0, 2))
        self.token_nums.copy_(per_expert.cumsum(0) if c.expert_token_nums_type == 0 else per_expert)
        self.recv_counts[: all_counts.numel()] = all_counts.cumsum(0).to(torch.int32)
        add_wait_time(c.wait_stats, agreement, wait_ns)

    def _place_torch(self, blocks: Parts, counts: torch.Tensor) -> int:
        """:meth:`place`'s placement in torch (where :func:`~deep_ep_npu.kernels.place_flat` does not apply): fills
        ``counts`` `[L, R]` and returns the pairs received (writes no row when they exceed the capacity)."""
        fmt, cap, dev = self.fmt, self.c.capacity, self.source.device
        got = [(src, rows, *parse(fmt, rows)) for src, rows in blocks]
        expert = torch.cat([ex for *_, ex in got])
        src = torch.cat([torch.full_like(ex, s) for s, _, _, _, ex in got])
        num_local, w = counts.shape
        key = expert * w + src
        order = torch.argsort(key, stable=True)
        counts += torch.bincount(key, minlength=num_local * w).view(num_local, w)
        if (num_recv := int(expert.numel())) > cap:
            return num_recv
        position = torch.empty_like(order)
        position[order] = torch.arange(num_recv, device=dev)  # each pair's final row
        for (s, rows, row, slot, _), at in zip(got, position.split([ex.numel() for *_, ex in got]), strict=True):
            if not at.numel():
                continue
            fmt.scatter_data(rows, row, self.expand_x, at)
            if self.c.quant is not None:
                self.scale_bytes[at] = fmt.scale_bytes(rows, row)
            triples = torch.stack([torch.full_like(row, s), fmt.tokens(rows)[row].long(), slot], dim=1)
            self.assist[: 3 * cap].view(-1, 3)[at] = triples.to(torch.int32)
            if self.weights is not None:
                self.expand_scales[at] = fmt.weights(rows)[row, slot]
        return num_recv


layout = _Flat


def static_round(engine: Any, c: FlatDispatch | FlatCombine) -> bool:
    """Whether the flat call ``c`` takes the static round of :mod:`.static_flat` (see there): values unchecked, the
    torch code on CPU tensors of a gloo group, routed experts, no smooth scales nor combine quantization."""
    if c.x.device.type != "cpu" or kernels.library() is not None:  # (CPU: the torch code)
        return False
    e, coll = c.experts, engine.collective
    if not (e.plain and e.logical_rank >= 0 and not e.shared_expert_num and e.num_local > 0 and e.tp is None):
        return False
    (t, k), r, hidden = c.expert_ids.shape, e.world_size, c.x.shape[1]
    if isinstance(c, FlatDispatch):
        simple = c.quant is None or c.scales is None
        fmt = row_format(hidden, c.x.dtype, c.quant, k, c.expert_scales is not None)
        rows_bytes = (c.num_max or t) * fmt.row_bytes  # (static_flat's message: N rows)
    else:
        simple = not (c.comm_quant_mode or e.copy_expert_num or e.const_expert_num)
        rows_bytes = (c.global_bs // r or t) * k * hidden * c.x.element_size()  # (its tokens' pairs come back)
    on_round = not engine.ep.enable_shrink and engine.transport_for(c.x.device) is coll and coll.early_bytes > 0
    fits = static.fits(coll, rows_bytes, 1 + 2 * r + 16)  # (header(): 16 fingerprint words)
    return simple and on_round and fits and not values_checked(c.x)  # (gloo's bounded receives: transports.static)


def fingerprint(c: FlatDispatch, fmt: RowFormat) -> tuple[int, ...]:
    """The words every rank's dispatch must agree on (:data:`NAMES`), then the batch size (:func:`check_batch`)."""
    e, x, q = c.experts, c.x, c.quant
    return (
        e.num_moe_experts,
        x.shape[1],
        c.expert_ids.shape[1],
        0 if q is None else q.mode,
        c.num_max * e.world_size,
        fmt.row_bytes,
        DTYPE_CODES[x.dtype],
        e.shared_expert_num,
        e.shared_expert_rank_num,
        hash(e.ep_rank_of) & 0x7FFFFFFF,
        e.tp_world_size,
        SCALAR_TYPE_CODE[fmt.data_dtype],
        OP_COMM_ALGS.index(c.comm_alg),
        x.shape[0],
    )


def check_batch(c: FlatDispatch, ep: Any, agreement: Agreement) -> None:
    """``global_bs`` 0 needs the same Bs on every rank (the fingerprint's last word)."""
    batch = [fp[1 + 2 * ep.num_ranks + len(NAMES)] for fp in agreement.shared]
    if c.global_bs == 0 and len({batch[r] for r in ep.live}) > 1:
        why = f"is 0 but x has different batch sizes across ranks (per rank: {batch}); pass global_bs = max(Bs) * W"
        raise shape("global_bs", why)


def combine_fingerprint(c: FlatCombine) -> tuple[int, ...]:
    """The words every rank's combine must agree on (:data:`COMBINE_NAMES`)."""
    e = c.experts
    return (
        e.num_moe_experts,
        c.x.shape[1],
        DTYPE_CODES[c.x.dtype],
        c.comm_quant_mode,
        c.global_bs,
        e.shared_expert_num,
        e.shared_expert_rank_num,
        hash(e.ep_rank_of) & 0x7FFFFFFF,
        e.tp_world_size,
        OP_COMM_ALGS.index(c.comm_alg),
    )


def add_wait_time(performance_info: torch.Tensor | None, agreement: Agreement, wait_ns: int) -> None:
    """Add this call's wait (µs: the agreement step plus the payload wait) to ``performance_info[src]`` for every
    source rank that sent this rank data (one collective serves all sources, so they share its wait time)."""
    if performance_info is None:
        return
    sent = torch.tensor([bool(c and c[0]) for c in agreement.counts], device=performance_info.device)
    performance_info += sent.to(torch.int64) * (agreement.wait_us + wait_ns // 1000)


def return_rows(assist: torch.Tensor, num_rows: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Rows ``[0, num_rows)`` of ``expand_x`` grouped by source rank (``assist_info_for_combine``'s triples),
    expert-major inside each source, and rows per source (none to masked sources)."""
    w, src = mask.numel(), assist[: 3 * num_rows : 3].long()
    if num_rows and (int(src.min()) < 0 or int(src.max()) >= w):
        raise shape("assist_info_for_combine", "holds a source rank outside [0, W); pass dispatch's output unchanged")
    order = torch.argsort(src, stable=True)
    per_src = torch.bincount(src, minlength=w)
    if bool(mask.any()):
        keep = mask.to(src.device)[src[order]] == 0
        order, per_src = order[keep], per_src.masked_fill(mask.to(src.device).bool(), 0)
    return order, per_src.tolist()


def combine_jobs(c: FlatCombine, engine: Any) -> list[CombineJob]:
    """The combine of a flat dispatch's rows ``c.x`` (TP: the ReduceScatterV over the pair runs after the agreement
    step, before the EP return)."""
    e, x, hidden = c.experts, c.x, c.x.shape[1]
    plan = plan_call(e, c.expert_ids, c.x_active_mask, engine.mask, True)
    num_rows, num_peer = (c.num_rows, c.num_peer) if c.num_rows >= 0 else ascend.sent_rows(e, c.handle[1])
    rows, rows_per_src = return_rows(c.handle[0], num_rows, engine.mask)
    extra, addend, active = None, c.shared_expert_x, None
    if c.x_active_mask is not None and c.x_active_mask.dim() == 1:
        active = int(c.x_active_mask.sum())  # only the active prefix is written (zero here; untouched on the NPU)
    if e.logical_rank < 0:  # scaled out by elastic_info: takes no part, returns zeros
        addend, active = None, 0
    elif e.copy_expert_num or e.const_expert_num:
        extra = special_contributions(c)
    fingerprint = combine_fingerprint(c)
    out = c.out if c.out is not None else x.new_empty((c.expert_ids.shape[0], hidden))
    weights = pair_weights(plan, c.expert_scales, c.expert_ids.shape[1])
    job = CombineJob(
        x,
        rows,
        rows_per_src,
        plan,
        weights,
        c.comm_quant_mode,
        out,
        fingerprint,
        COMBINE_NAMES,
        MISMATCH,
        by_slot=True,
        extra=extra,
        addend=addend,
        active=active,
        agree_now=True,
    )
    max_bs, k = c.global_bs // e.world_size or c.expert_ids.shape[0], c.expert_ids.shape[1]
    job.capacity = max_bs * k  # (the rows one source returns: its tokens' pairs here)
    job.on_wait = partial(add_wait_time, c.wait_stats)
    if (tp := e.tp) is not None:

        def reduce_scatter() -> bool:
            job.source = tp_reduce_scatter(tp, e.tp_rank_id, x, num_rows, num_peer)
            return True  # the rows to return changed: write them again

        job.tp = TPStage(e, c.op, x, bool(c.comm_quant_mode), job.fmt.row_bytes, reduce_scatter)
    return [job]


class TPStage:
    """The TP pair's part of one EP call: its agreement (status and ``fingerprint``) between the EP agreement and the
    payload (:meth:`before_payload`, then ``after()``, e.g. the ReduceScatterV; True: the rows changed), or, when the
    EP call failed before it, the failure's code (:meth:`abort`), so that the TP peer raises too."""

    def __init__(
        self,
        e: Experts,
        op: str,
        x: torch.Tensor,
        quantized: bool,
        row_bytes: int,
        after: Callable[[], bool] | None = None,
    ) -> None:
        self.tp, self.op, self.after, self.told = e.tp, op, after, False
        self.fingerprint = (x.shape[1], DTYPE_CODES[x.dtype] * 4 + 2 * quantized, row_bytes, e.num_moe_experts)

    def before_payload(self) -> bool:
        self.told = True
        tp_agree(self.tp, STATUS_OK, self.op, self.fingerprint)
        return self.after() if self.after is not None else False

    def abort(self, code: int) -> None:
        if not self.told:
            tp_agree(self.tp, code, self.op)
