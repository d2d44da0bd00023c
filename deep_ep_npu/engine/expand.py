"""DeepEP V2's layouts (``ElasticBuffer``): one row per (source token, this rank), or with ``do_expand`` one per
(token, local expert).

A row's payload is raw bytes, ``[x | scale factors | top-k weights fp32]`` (:class:`Payload`): fp8 data and its
scale factors arrive bit for bit. Non-expand rows: by source rank, then token. Expand rows: by local expert (expert
``e``'s segment starts at ``align(psum[e - 1], expert_alignment)``), then (source rank, token). A cached handle keeps
the :class:`Placement` and the send plan, so a cached dispatch places rows the same way with no count exchange.
Combine returns one row per (token, rank) (expand: the token's rows summed in fp32 in top-k order, rounded once;
every row without multiple reduction); the source adds in fp32 the bias, then the rows in the order of each rank's
last top-k slot, and rounds once (DeepEP's reference order). ``topk_weights`` travel back the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import kernels
from ..core.call import ExpandCombine, ExpandDispatch
from ..errors import shape
from ..handle import EPHandle
from ..transports.agreement import Agreement
from .plan import Plan, make_plan, plan_topk
from .reduce import CombineJob
from .rows import Parts, align, row_format, slot_table

X_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
SF_DTYPE_CODES = {None: 0, torch.float32: 1, torch.int32: 2}
MISMATCH = ("handle", "the handle of this layer's dispatch on every rank")
NAMES = ("cached handle", "num_max_tokens_per_rank", "num_experts", "hidden", "x dtype", "scale-factor columns",
         "scale-factor dtype", "num_topk", "row bytes")  # fmt: skip
COMBINE_NAMES = ("num_max_tokens_per_rank", "num_experts", "hidden", "x dtype", "topk_weights given")
Fresh = Callable[[tuple[int, ...], torch.dtype, bool], torch.Tensor]
"""``fresh(shape, dtype, zeros)``: a new result tensor (:meth:`~deep_ep_npu.engine.exchange.Engine.fresh`)."""


class Payload:
    """How a row's bytes split: ``x`` `[hidden]` in ``x_dtype``, ``sf`` `[sf_cols]` (4-byte ``sf_dtype``, or none),
    the weights `[num_topk]` fp32 (zeros when the caller gave none); of x `[T, hidden]` and sf `[T, sf_cols]`."""

    def __init__(self, x: torch.Tensor, sf: torch.Tensor | None, num_topk: int) -> None:
        self.hidden, self.x_dtype, self.num_topk = x.shape[1], x.dtype, num_topk
        self.sf_cols, self.sf_dtype = 0 if sf is None else sf.shape[1], None if sf is None else sf.dtype
        self.x_bytes = self.hidden * self.x_dtype.itemsize
        self.sf_end = self.x_bytes + 4 * self.sf_cols
        self.num_bytes = self.sf_end + 4 * num_topk

    def tail(self, x: torch.Tensor, sf: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor:
        """`[T, num_bytes - x_bytes]` uint8: each token's bytes after its x row, from sf `[T, sf_cols]` and weights
        `[T, K]` fp32 (None: 0); the rows' x bytes are gathered straight from x `[T, hidden]`."""
        out = torch.zeros((x.shape[0], self.num_bytes - self.x_bytes), dtype=torch.uint8, device=x.device)
        if sf is not None:
            out[:, : self.sf_end - self.x_bytes].view(sf.dtype).copy_(sf)
        if weights is not None:
            out[:, self.sf_end - self.x_bytes :].view(torch.float32).copy_(weights)
        return out

    def fields(self, rows: torch.Tensor, at: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Views of ``rows`` `[n, >= num_bytes - at]` uint8 (their bytes from ``at`` on; ``at`` = x_bytes: no x):
        x `[n, hidden]`, sf `[n, sf_cols]` (or None), weights."""
        sf = rows[:, self.x_bytes - at : self.sf_end - at].view(self.sf_dtype) if self.sf_dtype is not None else None
        weights = rows[:, self.sf_end - at : self.num_bytes - at].view(torch.float32)
        return rows[:, : self.x_bytes - at].view(self.x_dtype), sf, weights


@dataclasses.dataclass
class Placement:
    """Where one dispatch put its rows (kept by the handle; the same topk_idx places the same way). ``rows_from``:
    rows per source rank (this rank's own included); ``slots`` `[num_recv, K]` int32: each received row's local
    expert per top-k slot (-1: not here), rows in layout order; ``pair_row`` / ``pair_slot`` / ``pair_pos`` `[P]`
    int64: each (row, slot) pair for this rank and its expand row; ``counts`` `[L]` int64: pairs per local expert
    (``aligned``: rounded up to the alignment); ``num_rows`` / ``num_expanded``: the allocated rows (exact, or the
    worst case without CPU sync)."""

    rows_from: list[int]
    slots: torch.Tensor
    pair_row: torch.Tensor
    pair_slot: torch.Tensor
    pair_pos: torch.Tensor
    counts: torch.Tensor
    aligned: torch.Tensor
    num_rows: int
    num_expanded: int


def make_placement(
    slots: torch.Tensor,
    rows_from: list[int],
    num_local: int,
    alignment: int,
    sizes: tuple[int, int] | None,
    pairs: bool = True,
) -> Placement:
    """The placement of received tokens in layout order: ``slots`` `[total, K]` int32 (each one's local expert per
    slot, -1: not here), ``rows_from`` tokens per source rank; ``sizes``: the rows to allocate (None: exact);
    without ``pairs`` (non-expand rows: only the counts are read) the pair tensors are empty."""
    total, a = slots.shape[0], alignment
    if not pairs:
        counts = torch.bincount(slots.flatten().long() + 1, minlength=num_local + 1)[1:]
        aligned, none = (counts + a - 1) // a * a, torch.empty((0,), dtype=torch.int64, device=slots.device)
        num_rows, num_expanded = sizes or (total, int(aligned.sum()))
        return Placement(rows_from, slots, none, none, none, counts, aligned, num_rows, num_expanded)
    pair_row, pair_slot = (slots >= 0).nonzero(as_tuple=True)
    expert = slots[pair_row, pair_slot].long()
    order = torch.argsort(expert * max(total, 1) + pair_row)  # by (local expert, row): rows are (source, token)
    pair_row, pair_slot, expert = pair_row[order], pair_slot[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local)
    aligned = (counts + a - 1) // a * a
    start = aligned.cumsum(0) - aligned
    pos = start[expert] + torch.arange(expert.numel(), device=expert.device) - (counts.cumsum(0) - counts)[expert]
    num_rows, num_expanded = sizes or (total, int(aligned.sum()))
    return Placement(rows_from, slots, pair_row, pair_slot, pos, counts, aligned, num_rows, num_expanded)


class Outputs:
    """A V2 dispatch's outputs (``ElasticBuffer.dispatch``'s, and the tensors of its ``handle``: ``metadata`` is
    ``recv_src_metadata``, ``psum_per_rank`` / ``psum_per_expert`` / ``counts`` the prefix sums and counts)."""

    def __init__(self, c: ExpandDispatch, p: Payload, num_rows: int, num_expanded: int, fresh: Fresh | None) -> None:
        dev, k, r, num_local = c.x.device, p.num_topk, c.experts.world_size, c.experts.num_local
        rows = num_expanded if c.do_expand else num_rows
        new = torch.zeros if c.zero_padding else torch.empty
        self.sf = None
        if p.sf_dtype is not None:  # TMA-aligned column-major scale factors: strides (1, align(rows, 4))
            tma = new((p.sf_cols, -(-rows // 4) * 4), dtype=p.sf_dtype, device=dev).t()[:rows] if c.tma_sf else None
            self.sf = tma if tma is not None else new((rows, p.sf_cols), dtype=p.sf_dtype, device=dev)
        x = None if fresh is None else fresh((rows, p.hidden), p.x_dtype, c.zero_padding)
        self.x = new((rows, p.hidden), dtype=p.x_dtype, device=dev) if x is None else x
        self.weights = torch.zeros((rows,) if c.do_expand else (rows, k), dtype=torch.float32, device=dev)
        self.topk_idx = None if c.do_expand else torch.full((rows, k), -1, dtype=torch.int64, device=dev)
        self.metadata = torch.full((num_rows, k + 2), -1, dtype=torch.int32, device=dev)
        self.psum_per_rank = torch.empty((r,), dtype=torch.int32, device=dev)
        self.psum_per_expert = torch.empty((num_local,), dtype=torch.int32, device=dev)
        self.counts = torch.empty((num_local,), dtype=torch.int32, device=dev)
        self.handle: EPHandle | None = None


def sizes_of(c: ExpandDispatch, num_topk: int) -> tuple[int, int] | None:
    """The rows to allocate before the receive: a cached handle's, DeepEP's worst case without CPU sync (``R * N``
    rows, ``align(R * N * min(K, L) + (a - 1) * L, a)`` expanded rows), else None (exact, known at the receive)."""
    e, h, a = c.experts, c.cached, c.alignment
    if h is not None:
        return h.num_recv_tokens, h.num_expanded_tokens
    if c.recv_rows:
        return c.recv_rows, 0
    rn = e.world_size * c.num_max
    return None if c.cpu_sync else (rn, align(rn * min(num_topk, e.num_local) + (a - 1) * e.num_local, a))


def new_handle(
    c: ExpandDispatch, out: Outputs, place: Placement | None, sizes: tuple[int, int] | None, state: dict[str, Any]
) -> EPHandle:
    """The handle of a fresh dispatch (``state``: what its backend keeps)."""
    num_rows, num_expanded = sizes or (place.num_rows, place.num_expanded)  # type: ignore[union-attr]
    listed = [] if not c.cpu_sync or place is None else place.aligned.tolist()
    ids, r = c.expert_ids.long(), c.experts.world_size  # slot_idx: each slot's row among the rows its token sends
    used = ids >= 0  # to its expert's rank (tokens ascending there; -1: no expert)
    dest = torch.where(used, ids // c.experts.num_local, r)
    sends = torch.zeros((ids.shape[0], r + 1), dtype=torch.int64, device=ids.device).scatter_(1, dest, 1)[:, :r]
    before = sends.cumsum(0) - sends
    slot_idx = torch.where(used, before.gather(1, dest.clamp(max=r - 1)), -1).to(torch.int32)
    return EPHandle(
        c.do_expand,
        c.experts.num_moe_experts,
        c.alignment,
        c.num_max,
        0,
        c.expert_ids.clone() if c.handle_copy else c.expert_ids,
        num_rows,
        num_expanded if c.do_expand else 0,
        listed,
        out.psum_per_rank,
        out.psum_per_expert,
        out.counts,
        out.metadata,
        slot_idx,
        state,
    )


def receive(
    c: ExpandDispatch,
    p: Payload,
    place: Placement,
    x: torch.Tensor,
    sf: torch.Tensor | None,
    weights: torch.Tensor,
    tokens: torch.Tensor | None,
    out: Outputs | None,
    make_handle: Callable[[Outputs, Placement | None], EPHandle],
    fresh: Fresh | None = None,
) -> Outputs:
    """Write the received tokens (x `[n, hidden]`, sf, weights `[n, K]`, in layout order) where ``place`` says into
    ``out`` (None: allocated now) and, for a fresh layout (``tokens`` `[n]`: each row's source token), the handle's
    tensors: source metadata, prefix sums, counts."""
    out = out or Outputs(c, p, place.num_rows, place.num_expanded, fresh)
    n, rows, dev = x.shape[0], place.pair_row, x.device
    at: Any = place.pair_pos if c.do_expand else slice(n)  # expand: each pair's row, else the rows as they came
    if x.data_ptr() != out.x.data_ptr():  # (non-expand rows may already be in place: _Expand.place)
        out.x[at] = x.index_select(0, rows) if c.do_expand else x
        if sf is not None and out.sf is not None:
            out.sf[at] = sf.index_select(0, rows) if c.do_expand else sf
        out.weights[at] = weights[rows, place.pair_slot] if c.do_expand else weights
    if out.topk_idx is not None:  # (not expand)
        out.topk_idx[:n] = place.slots
    if tokens is not None:
        rows_from = torch.tensor(place.rows_from, device=dev)
        sources = torch.arange(len(place.rows_from), dtype=torch.int32, device=dev)
        src = sources.repeat_interleave(rows_from, output_size=n)
        out.metadata[:n, 0], out.metadata[:n, 1] = src * c.num_max + tokens.to(torch.int32), src
        if c.do_expand:
            out.metadata[rows, 2 + place.pair_slot] = place.pair_pos.to(torch.int32)
        psum = place.aligned.cumsum(0)
        out.psum_per_rank.copy_(rows_from.cumsum(0))
        out.psum_per_expert.copy_(psum - place.aligned + place.counts if c.do_expand else psum)
        out.counts.copy_(place.counts)
    if c.recv_stats is not None:
        c.recv_stats.add_(place.counts.to(c.recv_stats.dtype))
    if out.handle is None:
        out.handle = c.cached or make_handle(out, place)
    out.handle.state["placement"] = place
    return out


class _Expand:
    """The layout of one V2 dispatch (the :class:`.Layout` protocol); :meth:`result` is its
    :class:`Outputs` (None until allocated: with CPU sync, at the receive)."""

    weights, smooth, tp, names, agree_now = None, None, None, NAMES, False

    def __init__(self, c: ExpandDispatch, engine: Any) -> None:
        e, h = c.experts, c.cached
        self.c, self.ep = c, engine.ep
        self.payload = p = Payload(c.x, c.x_sf, c.expert_ids.shape[1])
        if h is not None:
            self.plan = h.state["plan"]
        else:
            no_mask = torch.zeros(e.world_size, dtype=torch.int32)
            self.plan = plan_topk(c.expert_ids, e.num_local, e.world_size, e.rank, no_mask, per_pair_rows=False)
        self.cached: Placement | None = None if h is None else h.state["placement"]
        self.fmt = row_format(p.num_bytes, torch.uint8, None, p.num_topk, False)
        self.source = c.x.contiguous().view(torch.uint8)  # the rows' x bytes: gathered straight into the send rows
        self.tail, self.slots = p.tail(c.x, c.x_sf, c.expert_scales), slot_table(self.plan, p.num_topk)
        self.own_placed = False
        past = 0 < engine.early_bytes < c.num_max * self.fmt.row_bytes  # (a rank's rows may pass the bound)
        expect = None if self.cached is None else list(self.cached.rows_from)  # (checked by every rank: check())
        self.known = None if past else expect
        self.vectors = (*self.plan.rows_per_dest, *(expect or [-1] * e.world_size))
        self.fingerprint = (
            int(h is not None),
            c.num_max,
            e.num_moe_experts,
            p.hidden,
            X_DTYPE_CODES[p.x_dtype],
            p.sf_cols,
            SF_DTYPE_CODES[p.sf_dtype],
            p.num_topk,
            self.fmt.row_bytes,
        )
        self.sizes = sizes_of(c, p.num_topk)
        state = dict(owner=engine, plan=self.plan, payload=p)
        sizes = self.sizes  # (a closure over self would make a cycle: results freed late)
        self.make_handle = lambda out, place: new_handle(c, out, place, sizes, state)
        self.fresh: Fresh = engine.fresh
        self.outputs = None if self.sizes is None else Outputs(c, p, *self.sizes, self.fresh)
        if self.outputs is not None:
            self.outputs.handle = h if h is not None else self.make_handle(self.outputs, None)

    def result(self) -> Outputs | None:
        return self.outputs

    def fields(self, d: int, out: torch.Tensor) -> None:
        """The sf and weight bytes of the rows for rank d (``out`` `[n, row_bytes]` uint8; x, token and slots are
        the encoder's)."""
        if self.payload.num_bytes > self.payload.x_bytes:
            token = self.plan.row_token[self.plan.row_slices()[d]]
            out[:, self.payload.x_bytes : self.payload.num_bytes] = self.tail.index_select(0, token)

    def place_own(self, own_rows: torch.Tensor, encode: Callable[[], None]) -> None:
        """This rank's own rows straight from x into the outputs at their final rows, when the rows each source sends
        here are known (DeepEP normal mode's count round, a cached handle) and the outputs allocated; ``own_rows``
        then gets only the token and slot fields. Else ``encode()``."""
        c, plan, me, out = self.c, self.plan, self.ep.rank, self.outputs
        rows_from = list(c.recv_from) if c.recv_from else None if self.cached is None else self.cached.rows_from
        n = plan.rows_per_dest[me]
        if c.do_expand or out is None or rows_from is None or rows_from[me] != n:
            return encode()
        lo = sum(rows_from[:me])
        if lo + n > out.x.shape[0]:
            return encode()
        rows = plan.row_slices()[me]
        token, x, at = plan.row_token[rows], self.c.x, slice(lo, lo + n)
        if not (x.is_contiguous() and kernels.gather(x, token, out.x[at])):
            torch.index_select(x, 0, token, out=out.x[at])
        _, sf, weights = self.payload.fields(self.tail.index_select(0, token), self.payload.x_bytes)
        out.weights[at] = weights
        if sf is not None and out.sf is not None:
            out.sf[at] = sf
        self.fmt.write_fields(own_rows, token, self.slots[rows], None)
        self.own_placed = True

    def check(self, agreement: Agreement) -> None:
        """With every rank reusing a handle: the rows one rank sends another are what the other expects."""
        r, shared, at = self.ep.num_ranks, agreement.shared, 1 + 2 * self.ep.num_ranks
        if not all(fp[at] == 1 for fp in shared):
            return  # (some ranks reuse a handle and others do not: "cached handle" differs)
        live = self.ep.live
        if bad := [(p, q) for p in live for q in live if p != q and shared[p][1 + q] != shared[q][1 + r + p]]:
            (p, q), n = bad[0], len(bad)
            why = f"rank {p}'s handle sends {shared[p][1 + q]} rows to rank {q}, whose handle expects"
            fix = "every rank must pass the handle of the same dispatch"
            raise shape("handle", f"{why} {shared[q][1 + r + p]} from it ({n} rank pairs differ): {fix}")

    def place(self, parts: Parts, own: tuple[int, torch.Tensor], agreement: Agreement, wait_ns: int) -> None:
        by_src, r, c = dict([*parts, own]), self.ep.num_ranks, self.c
        got = [by_src[s] for s in range(r) if s in by_src]  # by source, tokens ascending
        # non-expand: only the small token / slot fields are staged; the payload goes straight to the outputs
        fields = slice(0 if c.do_expand else self.fmt.token_off, None)
        staged = torch.cat([g[:, fields] for g in got])
        place, tokens = self.cached, None
        if place is None:
            rows_from = [by_src[s].shape[0] if s in by_src else 0 for s in range(r)]
            head = staged[:, self.fmt.token_off - fields.start :].view(torch.int32)  # token, then the slots
            tokens, num_local = head[:, 0], c.experts.num_local
            slots = head[:, 1 : 1 + self.fmt.num_slots]
            place = make_placement(slots, rows_from, num_local, c.alignment, self.sizes, c.do_expand)
        if c.do_expand:
            x, sf, weights = self.payload.fields(staged)
        else:
            sizes = (place.num_rows, place.num_expanded)
            self.outputs = out = self.outputs or Outputs(c, self.payload, *sizes, self.fresh)
            begin = 0
            for s, g in ((s, by_src[s]) for s in range(r) if s in by_src):
                rows = slice(begin, begin := begin + g.shape[0])
                if s == self.ep.rank and self.own_placed:
                    continue
                x, sf, weights = self.payload.fields(g)
                if not kernels.gather(x, torch.arange(len(x), device=x.device), out.x[rows]):
                    out.x[rows] = x
                out.weights[rows] = weights
                if sf is not None and out.sf is not None:
                    out.sf[rows] = sf
            x, sf, weights = out.x[:begin], None, out.weights[:begin]
        made = self.make_handle
        self.outputs = receive(c, self.payload, place, x, sf, weights, tokens, self.outputs, made, self.fresh)


layout = _Expand


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[num_recv, hidden]` in x's dtype: each received token's expand rows (``slots`` `[num_recv, K]`, -1: none)
    summed in fp32 in top-k order, rounded once."""
    acc = torch.zeros((slots.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    for j in range(slots.shape[1]):  # (static shapes: rows without slot j add 0)
        used = slots[:, j : j + 1] >= 0
        acc += torch.where(used, x.index_select(0, slots[:, j].clamp(min=0).long()).float(), 0.0)
    return acc.to(x.dtype)


def _return_plan(h: EPHandle, rank: int, num_ranks: int, per_row: bool, by_rank: bool = False) -> Plan:
    """The source's view of the combine: per (token, rank) at the slot of the token's last expert there (``by_rank``:
    at slot = the rank, so the sum goes by rank), or (no multiple reduction) every dispatched pair; sorted as the
    expert ranks return the rows (cached in the handle)."""
    key = "rank_plan" if by_rank else "return_plan" if per_row else "pair_plan"
    if key in h.state:
        return h.state[key]
    plan, num_tokens, r = h.state["plan"], h.num_tokens, num_ranks
    pairs, num_local = (plan.token, plan.slot, plan.dest, plan.expert), h.num_experts // r
    if per_row:
        last = torch.full((num_tokens * r,), -1, dtype=torch.int64, device=plan.token.device)
        last.scatter_reduce_(0, plan.token * r + plan.dest, plan.slot, "amax")
        at = (last >= 0).nonzero(as_tuple=True)[0]
        pairs, num_local = (at // r, at % r if by_rank else last[at], at % r, torch.zeros_like(at)), 1
    h.state[key] = out = make_plan(*pairs, num_tokens, r, rank, num_local, per_pair_rows=True)
    return out


def combine_jobs(c: ExpandCombine, engine: Any) -> list[CombineJob]:
    """The combine of a V2 dispatch's rows ``c.x`` (and of ``c.expert_scales``, the weights to send back)."""
    h, x, rank, r = c.handle, c.x, c.experts.rank, c.experts.world_size
    place: Placement = h.state["placement"]
    total, num_tokens, hidden, dev = sum(place.rows_from), h.num_tokens, x.shape[1], x.device
    per_row = not h.do_expand or c.multiple_reduction  # one returned row per (token, rank)
    every_row = torch.arange(total, device=dev)
    if per_row:
        rows, rows_per_src = every_row, place.rows_from
        source = reduce_expanded(x, h.recv_src_metadata[:total, 2:]) if h.do_expand else x
    else:  # every expand row, by (source rank, local expert, token): the order the sources' pair plans expect
        src = h.recv_src_metadata[place.pair_row, 1].long()  # (each received row's source rank)
        expert = place.slots[place.pair_row, place.pair_slot].long()
        order = torch.argsort(src * (h.num_experts // r) + expert, stable=True)
        rows, rows_per_src, source = place.pair_pos[order], torch.bincount(src, minlength=r).tolist(), x
    plan, extra, weighted = _return_plan(h, rank, r, per_row, c.by_rank), None, c.expert_scales is not None
    if c.bias:  # the biases, first in the fp32 sum: at slot -1
        tokens, bias = torch.arange(num_tokens, device=dev), c.bias[0].float()
        bias = bias if len(c.bias) == 1 else bias + c.bias[1].float()
        extra = (tokens, torch.full_like(tokens, -1), bias)
    fingerprint = (h.num_max_tokens_per_rank, h.num_experts, hidden, X_DTYPE_CODES[x.dtype], int(weighted))
    ones, out = torch.ones_like(plan.token, dtype=torch.float32), engine.fresh((num_tokens, hidden), x.dtype)
    job = CombineJob(
        source,
        rows,
        list(rows_per_src),
        plan,
        ones,
        0,
        out,
        fingerprint,
        COMBINE_NAMES,
        MISMATCH,
        by_slot=True,
        extra=extra,
        agree_now=True,
    )
    job.capacity = h.num_max_tokens_per_rank * min(h.num_topk, h.num_experts // r)  # (per source: N tokens)
    if c.expert_scales is None:
        return [job]
    w = c.expert_scales  # the weights travel back the same way, each slot from its expert's rank
    if h.do_expand:
        w_rows = torch.zeros((total, h.num_topk), dtype=torch.float32, device=dev)
        w_rows[place.pair_row, place.pair_slot] = w[place.pair_pos]
    else:
        w_rows = w[:total] if c.raw_weights else w[:total].masked_fill(place.slots < 0, 0.0)
    plan = _return_plan(h, rank, r, True, c.by_rank)
    ones, out = torch.ones_like(plan.token, dtype=torch.float32), w_rows.new_empty((num_tokens, h.num_topk))
    w_job = dataclasses.replace(
        job,
        source=w_rows,
        return_rows=every_row,
        rows_per_src=list(place.rows_from),
        plan=plan,
        weights=ones,
        out=out,
        extra=None,
        riders=[],
    )
    if per_row and not job.fmt.quantized and job.fmt.row_bytes % 16 == 0:  # the weights ride in the rows of x
        job.riders.append(w_job)
        return [job]
    return [job, w_job]
