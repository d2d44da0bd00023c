"""Combine's reductions, at the source rank in fp32: the rows come back in the order the source's own plan predicts
(:mod:`.plan`), so only rows travel. :func:`reduce_own` takes this rank's own rows (never on the wire),
:func:`reduce_remote` the received ones. Order: ``by_slot`` (Ascend ops, DeepEP V2) sums slots ascending, with the
``extra`` contributions in their slots, then ``addend``; else (DeepEP) own experts first, then remote ranks in rank
order. :func:`check` cross-checks every rank's send and expect vectors (a wrong handle raises on every rank)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import kernels, logfmt
from ..core.call import FlatCombine
from ..errors import shape
from ..quant import Quant, mx_dequant, per_group_int8
from ..transports.agreement import Agreement
from ..transports.group import EPGroup
from .plan import Plan
from .rows import Parts


@dataclasses.dataclass
class CombineJob:
    """One validated combine, as every layout describes it. ``source`` `[rows, hidden]`: the expert outputs;
    ``return_rows`` `[n]` int64: the rows to send back, grouped by source rank (``rows_per_src``); ``plan``: this
    rank's pairs, ``weights`` `[P]` fp32 theirs; ``wire``: :class:`ReturnFormat`'s mode; ``out`` `[T, hidden]`;
    ``fingerprint`` / ``names``: what every rank must agree on; ``mismatch``: (parameter, what to pass) when sends
    and expects disagree; ``extra``: local (token, slot, value `[n, hidden]` fp32) contributions (copy / const
    experts, V2's bias); ``addend`` `[T, hidden]` added last; ``active``: tokens ``[0, active)`` are written, the
    rest 0; ``on_wait``: the wait statistics; ``tp``: the TP stage (:class:`~.flat.TPStage`); ``agree_now``: as
    :class:`.Layout`'s; ``capacity``: the most rows one rank returns another, the same on every rank when the calls
    agree (0: not known; the rows then wait for the agreement); ``acc`` / ``own_y``: :func:`reduce_own`'s results;
    ``riders``: jobs of the same plan and return rows, unquantized, whose rows travel in this job's wire rows
    (columns after its own: one exchange)."""

    source: torch.Tensor
    return_rows: torch.Tensor
    rows_per_src: list[int]
    plan: Plan
    weights: torch.Tensor
    wire: int
    out: torch.Tensor
    fingerprint: tuple[int, ...]
    names: tuple[str, ...]
    mismatch: tuple[str, str]
    by_slot: bool = False
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    addend: torch.Tensor | None = None
    active: int | None = None
    on_wait: Callable[[Agreement, int], None] | None = None
    tp: Any = None
    agree_now: bool = False
    capacity: int = 0
    acc: torch.Tensor | None = None  # the reduction: `[T, hidden]` fp32 sum, own rows `[own pairs, hidden]` fp32
    own_y: torch.Tensor | None = None
    riders: list[CombineJob] = dataclasses.field(default_factory=list)

    @property
    def own_rows(self) -> slice:
        """Where this rank's own rows sit in ``return_rows`` (sources in rank order)."""
        return slice(lo := sum(self.rows_per_src[: self.plan.rank]), lo + self.rows_per_src[self.plan.rank])

    @functools.cached_property
    def fmt(self) -> ReturnFormat:
        return ReturnFormat(self.source.shape[1], self.source.dtype, self.wire)


def check(job: CombineJob, ep: EPGroup, agreement: Agreement) -> None:
    """Raise (the same error on every rank) if the live ranks' send and expect vectors disagree (a wrong handle or
    top-k): ``shared[p]`` holds, after the row size, rank p's rows returned to each rank and its pairs sent to each."""
    r, live = len(job.rows_per_src), ep.live
    sends = [fp[1 : 1 + r] for fp in agreement.shared]  # sends[p][q]: rows rank p returns to rank q
    expects = [fp[1 + r : 1 + 2 * r] for fp in agreement.shared]  # expects[q][p]: pairs rank q sent to rank p
    if bad := [(p, q) for p in live for q in live if sends[p][q] != expects[q][p]]:
        (p, q), (param, hint) = bad[0], job.mismatch
        why = f"rank {p} would return {sends[p][q]} rows to rank {q}, which dispatched {expects[q][p]} pairs to it"
        raise shape(param, f"{why}; pass {hint} (mismatched rank pairs: {bad[:8]})")


def _fused(job: CombineJob) -> bool:
    """Whether rows go straight into the fp32 sum (``kernels.accumulate``), not through scratch."""
    return not job.by_slot and not job.fmt.quantized and job.source.device.type == "cpu"


def _fused_by_slot(job: CombineJob) -> bool:
    """Whether the slot-ordered sum runs in one pass (:func:`~deep_ep_npu.kernels.accumulate_rows`) from the rows where
    they are (no scratch copy): rows in the source's dtype, no copy / const contributions, the kernels there."""
    fmt, src = job.fmt, job.source
    plain = job.by_slot and not fmt.quantized and job.extra is None
    return plain and src.device.type == "cpu" and src.dtype == fmt.dtype and kernels.library() is not None


Scratch = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""``scratch(name, shape, dtype)``: a reused tensor of the engine (named per call in flight)."""


def reduce_own(job: CombineJob, scratch: Scratch) -> None:
    """Reduce this rank's own expert rows (they never touch the wire) into ``job.acc`` (by slot, or not fused: their
    fp32 values into ``job.own_y``)."""
    plan, fmt, dev = job.plan, job.fmt, job.source.device
    own, token, rows = plan.own_pairs, plan.token, job.return_rows[job.own_rows]
    job.acc = acc = scratch("combine_acc", (job.out.shape[0], fmt.hidden), torch.float32)
    summed = _fused(job) and kernels.accumulate(acc, job.source, rows, token[own], job.weights[own], zero_first=True)
    if summed or _fused_by_slot(job):  # (by slot: summed with the remote rows, in slot order, at the receive)
        return
    acc.zero_()
    raw = scratch("combine_own", (rows.numel(), fmt.hidden), job.source.dtype)
    torch.index_select(job.source, 0, rows, out=raw)
    if fmt.quantized:  # own rows take the same int8 round trip as the remote ones
        packed = torch.empty((raw.shape[0], fmt.row_bytes), dtype=torch.uint8, device=dev)
        fmt.encode(raw, packed)
        job.own_y = fmt.decode_float(packed)
    else:  # converted into reused scratch (a fresh tensor of this size costs its page faults every call)
        job.own_y = scratch("combine_own_f", tuple(raw.shape), torch.float32).copy_(raw)
    if not job.by_slot:
        _accumulate(acc, job.own_y, token[own], job.weights[own].unsqueeze(1))


def reduce_remote(job: CombineJob, scratch: Scratch, agreement: Agreement, received: Parts, wait_ns: int) -> None:
    """Add the received rows (each `[n_i, row_bytes]` uint8, by source rank, in this rank's plan order) in the
    documented order and write ``job.out`` (:func:`reduce_own` first if it has not run)."""
    if job.acc is None:
        reduce_own(job, scratch)
    plan, fmt, acc, parts = job.plan, job.fmt, job.acc, [rows for _, rows in received]
    assert acc is not None
    direct = job.own_y is None and job.addend is None and job.active is None
    if job.by_slot and direct and _sum_by_slot(job, job.out, parts, into_out=True):
        if job.on_wait is not None:
            job.on_wait(agreement, wait_ns)
        return
    if job.by_slot:  # slot after slot, ascending
        if job.own_y is not None or not _sum_by_slot(job, acc, parts):
            _sum_by_slot_torch(job, acc, parts, scratch)
    else:
        own, begin, done = plan.own_pairs, 0, 0
        tok, w = (torch.cat([t[: own.start], t[own.stop :]]) for t in (plan.token, job.weights))  # the remote pairs'
        for p in parts if _fused(job) else ():  # straight into the sum, part by part (in order)
            pairs = slice(begin, begin + len(p))
            if not kernels.accumulate(acc, p.view(fmt.dtype), None, tok[pairs], w[pairs]):
                break
            begin, done = pairs.stop, done + 1
        if rest := parts[done:]:  # the torch code for what the kernel did not take
            _accumulate(acc, decode_rows(job, rest, scratch), tok[begin:], w[begin:].unsqueeze(1))
    if job.addend is not None:
        acc.add_(job.addend.float())
    if job.active is not None:
        acc[job.active :] = 0.0
    job.out.copy_(acc)
    if job.on_wait is not None:
        job.on_wait(agreement, wait_ns)


def _sum_by_slot(job: CombineJob, acc: torch.Tensor, parts: list[torch.Tensor], into_out: bool = False) -> bool:
    """The by-slot sum in one pass over the rows where they are (``kernels.accumulate_rows``), rounded as the torch
    code's; ``into_out``: each token's sum straight into ``acc`` = ``job.out``, rounded once to its dtype
    (``kernels.sum_tokens``: the pairs by token, slots ascending). False (nothing done) where the kernel does not
    apply."""
    plan, own, dev = job.plan, job.plan.own_pairs, job.source.device
    if (orders := plan.orders.get(into_out)) is None:  # (once per plan: a cached handle's combines reuse them)
        y_at = torch.arange(plan.token.numel(), device=dev)  # pair -> its row: own rows, then the parts'
        y_at[: own.start] += own.stop - own.start
        y_at[own] -= own.start
        order = torch.argsort(plan.slot, stable=True)
        if into_out:
            order = order[torch.argsort(plan.token[order], stable=True)]
        orders = plan.orders[into_out] = (order, y_at[order], plan.token[order])
    rows = [(job.source, job.return_rows[job.own_rows]), *((p.view(job.fmt.dtype), None) for p in parts)]
    summed = kernels.sum_tokens if into_out else kernels.accumulate_rows
    return summed(acc, rows, orders[1], orders[2], job.weights[orders[0]])


def _sum_by_slot_torch(job: CombineJob, acc: torch.Tensor, parts: list[torch.Tensor], scratch: Scratch) -> None:
    """The by-slot sum in torch, with the ``extra`` contributions (own rows as fp32 when :func:`reduce_own` left them
    to the kernel, which did not apply: then ``acc`` starts from zeros here)."""
    plan, own = job.plan, job.plan.own_pairs
    if job.own_y is None:
        job.own_y = job.source.index_select(0, job.return_rows[job.own_rows]).float()
        acc.zero_()
    remote = decode_rows(job, parts, scratch)
    values = torch.cat([remote[: own.start], job.own_y, remote[own.start :]]).mul_(job.weights.unsqueeze(1))
    tok, slot = plan.token, plan.slot
    if job.extra is not None:
        tok, slot, values = (torch.cat([a, b]) for a, b in zip((tok, slot, values), job.extra, strict=True))
    for k in torch.unique(slot).tolist():
        sel = (slot == k).nonzero(as_tuple=True)[0]
        acc.index_add_(0, tok[sel], values[sel])


def decode_rows(job: CombineJob, parts: list[torch.Tensor], scratch: Scratch) -> torch.Tensor:
    """The received rows ``parts`` (each `[n_i, row_bytes]` uint8, by source rank) as one `[sum n_i, hidden]` fp32
    tensor (reused scratch when the rows are not quantized; :meth:`ReturnFormat.decode_float`'s values)."""
    fmt, sizes = job.fmt, [p.shape[0] for p in parts]
    y = scratch("combine_y", (sum(sizes), fmt.hidden), torch.float32)
    for p, out in zip(parts, y.split(sizes), strict=True):
        if p.shape[0]:
            out.copy_(fmt.decode_float(p) if fmt.quantized else p.view(fmt.dtype))
    return y


def _accumulate(acc: torch.Tensor, y: torch.Tensor, token: torch.Tensor, weights: torch.Tensor) -> None:
    """``acc[token[i]] += weights[i] * y[i]`` in fp32 (``y`` `[k, hidden]`, weights `[k, 1]` fp32; ``y`` is scratch,
    converted or scaled in place: a mixed-dtype mul would be slower)."""
    if token.numel():
        acc.index_add_(0, token, y.float().mul_(weights))


def special_contributions(c: FlatCombine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token `[n]`, slot `[n]`, value `[n, H]` fp32) of every active copy / const pair of a flat combine (ids
    ``moe_expert_num + [0, Z + C + Const)``, never sent: combine adds them locally; zero experts add nothing).
    ``c.ori_x`` `[Bs, H]`, ``c.const_expert_alpha_1`` / ``_alpha_2`` / ``_v`` `[const_expert_num, H]`. Values follow
    the kernel (``CalConstExpertAlpha`` / ``ProcessConstantExpert``), as documented on
    :func:`deep_ep_npu.ops.moe_distribute_combine_v2`: each alpha row is reduced to one scalar per token (dot products
    over H in fp32), not applied elementwise."""
    e, ids, mask, ori_x = c.experts, c.expert_ids.long(), c.x_active_mask, c.ori_x
    first_copy = e.num_moe_experts + e.zero_expert_num
    valid = ids >= first_copy
    if mask is not None:
        valid &= mask.unsqueeze(1) if mask.dim() == 1 else mask
    token, slot = valid.nonzero(as_tuple=True)
    if token.numel() == 0 or ori_x is None:
        hidden = 0 if ori_x is None else ori_x.shape[1]
        return token, slot, torch.zeros((0, hidden), dtype=torch.float32, device=ids.device)
    ori = ori_x[token].float()
    value, const = ori.clone(), ids[token, slot] - first_copy - e.copy_expert_num
    is_const, alpha_1, alpha_2, v = const >= 0, c.const_expert_alpha_1, c.const_expert_alpha_2, c.const_expert_v
    if bool(is_const.any()) and alpha_1 is not None and alpha_2 is not None and v is not None:
        cc, o = const[is_const], ori[is_const]
        d1, d2 = (alpha_1[cc].float() * o).sum(dim=1), (alpha_2[cc].float() * o).sum(dim=1)
        m = torch.maximum(d1, d2)
        e1, e2 = torch.exp(d1 - m), torch.exp(d2 - m)
        value[is_const] = (e1 / (e1 + e2)).unsqueeze(1) * o + (e2 / (e1 + e2)).unsqueeze(1) * v[cc].float()
    return token, slot, c.expert_scales[token, slot].unsqueeze(1) * value


LOGFMT = 10  # ReturnFormat's mode for DeepEP's LogFMT-10 (:mod:`deep_ep_npu.logfmt`)


class ReturnFormat:
    """A combine row for ``comm_quant_mode`` ``mode``: 0 the expert output in ``dtype``; 2 int8 + one ``dtype`` scale
    per 8 elements; 3 / 4 MX fp8 (e5m2 / e4m3, :func:`~deep_ep_npu.quant.mx_fp8`) + one e8m0 byte per 32;
    :data:`LOGFMT` DeepEP's LogFMT-10 of bf16 rows (decoded straight to fp32)."""

    def __init__(self, hidden: int, dtype: torch.dtype, mode: int) -> None:
        self.hidden, self.dtype, self.mode, self.quantized = hidden, dtype, int(mode), bool(mode)
        self.mx = Quant(4, torch.float8_e5m2 if mode == 3 else torch.float8_e4m3fn) if mode in (3, 4) else None
        scale_bytes = hidden // 8 * dtype.itemsize if self.mx is None else self.mx.scale_bytes(hidden)
        self.row_bytes = hidden + scale_bytes if mode else hidden * dtype.itemsize
        if self.mode == LOGFMT:
            self.row_bytes = logfmt.row_bytes(hidden)

    def encode(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``rows`` `[n, hidden]` into ``out`` `[n, row_bytes]` uint8."""
        if not self.quantized:
            out.view(self.dtype).copy_(rows)
        elif self.mode == LOGFMT:
            out.copy_(logfmt.encode(rows))
        else:
            q, scale = per_group_int8(rows) if self.mx is None else self.mx(rows)
            out[:, : self.hidden].view(q.dtype).copy_(q)
            out[:, self.hidden :].copy_(scale.contiguous().view(torch.uint8))

    def decode_float(self, packed: torch.Tensor) -> torch.Tensor:
        """`[n, row_bytes]` uint8 to `[n, hidden]` fp32 (a fresh tensor: callers scale it in place); quantized rows
        are dequantized and rounded to ``dtype`` first, as the NPU receives them."""
        if not self.quantized:
            return packed.view(self.dtype).float()
        if self.mode == LOGFMT:
            return logfmt.decode(packed, self.hidden)
        if self.mx is not None:
            y = mx_dequant(packed[:, : self.hidden].view(self.mx.dtype), packed[:, self.hidden :])
            return y.to(self.dtype).float()
        q = packed[:, : self.hidden].view(torch.int8).float().view(-1, self.hidden // 8, 8)
        scale = packed[:, self.hidden :].view(self.dtype).float().unsqueeze(-1)
        return (q * scale).view(-1, self.hidden).to(self.dtype).float()
