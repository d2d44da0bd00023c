"""``ElasticBuffer`` on the engine (the reference backend): DeepEP V2's dispatch / combine with the V2 layouts of
:mod:`deep_ep_npu.engine.elastic`.

Dispatch sends each token once per destination rank (its payload bytes as they are, the local expert of each slot
travelling with it). A cached handle reuses the send plan and the placement, and passes the rows each source sends
as known counts: no count exchange (:func:`~deep_ep_npu.engine.dispatch.start_dispatch`), the same positions bit for
bit. Combine returns one row per (token, rank): the caller's pre-reduced row (non-expand), or the sum of the token's
expand rows in top-k order (fp32, rounded once to x's dtype; every expand row as it is with
``allow_multiple_reduction=False``). The source adds, in fp32, the bias first, then the returned rows in the order of
each rank's last top-k slot (of every slot without multiple reduction), and rounds once: DeepEP's reference order.
"""

from __future__ import annotations

from typing import Any

import torch

from ..elastic_params import Combine, Dispatch
from ..engine.combine import CombineJob, start_combine
from ..engine.dispatch import DispatchJob, start_dispatch
from ..engine.elastic import X_DTYPE_CODES, ElasticLayout, Placement, fingerprint, release_cached_peers
from ..engine.plan import Plan, make_plan, plan_topk
from ..engine.rows import ReturnFormat, RowFormat
from ..ep_handle import EPHandle
from ..event import Completion
from . import LowLatencyBackend

DISPATCH_OP, COMBINE_OP = "elastic_dispatch", "elastic_combine"
COMBINE_NAMES = ("num_max_tokens_per_rank", "num_experts", "hidden", "x dtype", "topk_weights given")


class ElasticReference:
    """DeepEP V2 semantics on ``backend``'s group and workspace (see the module docstring)."""

    def __init__(self, backend: LowLatencyBackend, owner: object, allow_multiple_reduction: bool) -> None:
        self.ep, self.ws, self.owner = backend.ep, backend._ws, owner
        self.rank, self.num_ranks = backend.rank, backend.num_ranks
        self.multiple_reduction = allow_multiple_reduction
        self._tag = 0  # the wire buffers alternate: two calls may be in flight
        self._no_mask = torch.zeros(self.num_ranks, dtype=torch.int32)

    def _next_tag(self) -> str:
        self._tag ^= 1
        return f"_v2_{self._tag}"

    def _plan(self, topk_idx: torch.Tensor, num_local: int, per_pair_rows: bool) -> Plan:
        return plan_topk(topk_idx, num_local_experts=num_local, num_ranks=self.num_ranks, rank=self.rank,
                         mask=self._no_mask, per_pair_rows=per_pair_rows)  # fmt: skip

    def dispatch(self, d: Dispatch) -> tuple[ElasticLayout, EPHandle | None, Completion]:
        """Start ``d``; returns the layout (its ``outputs``), the handle if its tensors exist already (a cached one,
        or no CPU sync), and the receive, which returns the handle."""
        self.ws.device = d.x.device
        h, payload = d.handle, d.payload
        plan = self._plan(d.topk_idx, d.num_local, False) if h is None else h.state["plan"]
        cached: Placement | None = None if h is None else h.state["placement"]
        layout = ElasticLayout(self.rank, self.num_ranks, d.num_max, d.num_local, payload, d.alignment, d.do_expand,
                               d.zero_padding, d.tma_sf, d.x.device, d.sizes, cached, self.ep)  # fmt: skip
        fmt = RowFormat(payload.num_bytes, torch.uint8, None, payload.num_topk, False, False)
        known = None if cached is None else cached.rows_from
        agreed = fingerprint(plan.rows_per_dest, known, (d.num_max, d.num_experts, *payload.fingerprint), fmt.row_bytes)
        job = DispatchJob(
            self.ep, DISPATCH_OP, payload.pack(d.x, d.sf, d.topk_weights), plan, fmt, None, None, agreed, layout,
            self.ws, tag=self._next_tag(), known_counts=known, defer_payload=True,
        )  # fmt: skip
        completion = start_dispatch(job)
        handle = h if h is not None else self._handle(d, layout, plan, fmt.row_bytes) if d.sizes else None

        def finish() -> EPHandle:
            completion.wait()
            if d.stats is not None:
                counts = layout.outputs["counts"]
                assert counts is not None
                d.stats += counts
            out = handle if handle is not None else self._handle(d, layout, plan, fmt.row_bytes)
            out.state["placement"] = layout.placement
            return out

        return layout, handle, Completion(finish)

    def _handle(self, d: Dispatch, layout: ElasticLayout, plan: Plan, row_bytes: int) -> EPHandle:
        out, place = layout.outputs, layout.placement
        num_rows, num_expanded = d.sizes or (place.num_rows, place.num_expanded)  # type: ignore[union-attr]
        listed = [] if not d.do_cpu_sync or place is None else aligned_counts(place.counts, d.alignment).tolist()
        return EPHandle(
            d.do_expand, d.num_experts, d.alignment, d.num_max, d.num_sms,
            d.topk_idx.clone() if d.handle_copy else d.topk_idx, num_rows, num_expanded if d.do_expand else 0,
            listed, out["psum_per_rank"], out["psum_per_expert"], out["counts"], out["metadata"],  # type: ignore[arg-type]
            slot_idx(plan, d.topk_idx, self.rank),
            dict(owner=self.owner, plan=plan, row_bytes=row_bytes, payload=d.payload),
        )  # fmt: skip

    def reject_dispatch(self, code: int) -> None:
        """This rank rejected its dispatch: it takes part in the agreement step with status ``code``, and in the
        payload of the peers that reuse a handle with the rows each announced (whatever this rank's own handle says),
        so every peer raises too."""
        r, rest = self.num_ranks, (0,) * (len(ElasticLayout.names) - 2)
        agreed = self.ep.start_agree(DISPATCH_OP, code, [[0, 0]] * r, fingerprint([0] * r, None, rest, 0))()
        release_cached_peers(self.ep, agreed)

    def reject_combine(self, code: int) -> None:
        self.ep.reject(COMBINE_OP, code, 0, 2 * self.num_ranks + len(COMBINE_NAMES))

    def combine(self, c: Combine) -> tuple[torch.Tensor, torch.Tensor | None, Completion]:
        h, x = c.handle, c.x
        place: Placement = h.state["placement"]
        total, num_tokens, hidden = sum(place.rows_from), h.num_tokens, x.shape[1]
        self.ws.device = x.device
        per_row = not h.do_expand or self.multiple_reduction  # one returned row per (token, rank)
        if per_row:
            rows, rows_per_src = torch.arange(total, device=x.device), place.rows_from
            source = reduce_expanded(x, h.recv_src_metadata[:total, 2:]) if h.do_expand else x
            plan = _cached(h, "return_plan", lambda: self._return_plan(h, True))
        else:
            rows, rows_per_src = _expand_return_rows(place, self.num_ranks, h.num_experts // self.num_ranks)
            source = x
            plan = _cached(h, "pair_plan", lambda: self._return_plan(h, False))
        extra = None
        if c.bias is not None:  # first in the fp32 sum: at slot -1
            tokens = torch.arange(num_tokens, device=x.device)
            extra = (tokens, torch.full_like(tokens, -1), c.bias)
        weighted = c.topk_weights is not None
        fingerprint = (h.num_max_tokens_per_rank, h.num_experts, hidden, X_DTYPE_CODES[x.dtype], int(weighted))
        combined = x.new_empty((num_tokens, hidden))
        jobs = [(source, rows, rows_per_src, plan, ReturnFormat(hidden, x.dtype, 0), combined, extra, fingerprint)]
        combined_weights = None
        if c.topk_weights is not None:  # the weights travel back the same way, each slot from its expert's rank
            w_rows = _slot_weights(c.topk_weights, place, h, total)
            combined_weights = torch.empty((num_tokens, h.num_topk), dtype=torch.float32, device=x.device)
            weight_plan = _cached(h, "return_plan", lambda: self._return_plan(h, True))
            jobs.append((w_rows, torch.arange(total, device=x.device), place.rows_from, weight_plan,
                         ReturnFormat(h.num_topk, torch.float32, 0), combined_weights, None, fingerprint))  # fmt: skip
        completions = []  # each job's agreement is awaited in its send phase: a peer's rejection stops the next one
        for src, ret, per_src, pl, fmt, out, add, fp in jobs:
            job = CombineJob(
                self.ep, COMBINE_OP, src, ret, list(per_src), pl, torch.ones_like(pl.token, dtype=torch.float32), fmt,
                num_tokens, out, fp, COMBINE_NAMES, ("handle", "the handle of this layer's dispatch on every rank"),
                self.ws, tag=self._next_tag(), by_slot=True, extra=add,
            )  # fmt: skip
            completions.append(start_combine(job))
        return combined, combined_weights, Completion(lambda: [cp.wait() for cp in completions])

    def _return_plan(self, h: EPHandle, per_row: bool) -> Plan:
        """The source's view of the combine: per (token, rank) at the slot of the token's last expert there, or (no
        multiple reduction) every dispatched pair; sorted as the expert ranks return the rows."""
        plan, num_tokens, r = h.state["plan"], h.num_tokens, self.num_ranks
        if not per_row:
            return make_plan(plan.token, plan.slot, plan.dest, plan.expert, num_tokens=num_tokens, num_ranks=r,
                             rank=self.rank, num_local_experts=h.num_experts // r, per_pair_rows=True)  # fmt: skip
        last = torch.full((num_tokens * r,), -1, dtype=torch.int64, device=plan.token.device)
        last.scatter_reduce_(0, plan.token * r + plan.dest, plan.slot, "amax")
        key = (last >= 0).nonzero(as_tuple=True)[0]
        token, dest = key // r, key % r
        return make_plan(token, last[key], dest, torch.zeros_like(dest), num_tokens=num_tokens, num_ranks=r,
                         rank=self.rank, num_local_experts=1, per_pair_rows=True)  # fmt: skip


def _cached(h: EPHandle, name: str, build: Any) -> Any:
    if name not in h.state:
        h.state[name] = build()
    return h.state[name]


def aligned_counts(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    return (counts + alignment - 1) // alignment * alignment


def slot_idx(plan: Plan, topk_idx: torch.Tensor, rank: int) -> torch.Tensor:
    """`[T, K]` int32: slot j's row among the rows this rank sends to that expert's rank (-1: no expert)."""
    r = len(plan.rows_per_dest)
    order = [d for d in range(r) if d != rank] + [rank]  # the send buffer's rank order (own rows last)
    start = [0] * r
    for prev, d in zip([None, *order], order, strict=False):
        start[d] = 0 if prev is None else start[prev] + plan.rows_per_dest[prev]
    out = torch.full(topk_idx.shape, -1, dtype=torch.int32, device=topk_idx.device)
    base = torch.tensor(start, device=topk_idx.device)[plan.dest]
    out[plan.token, plan.slot] = (plan.row_of_pair - base).to(torch.int32)
    return out


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[num_recv, hidden]` in x's dtype: each received token's expand rows (``slots`` `[num_recv, K]`, -1: none)
    summed in fp32 in top-k order, rounded once."""
    acc = torch.zeros((slots.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    for j in range(slots.shape[1]):
        row = (slots[:, j] >= 0).nonzero(as_tuple=True)[0]
        acc.index_add_(0, row, x.index_select(0, slots[row, j].long()).float())
    return acc.to(x.dtype)


def _expand_return_rows(place: Placement, num_ranks: int, num_local: int) -> tuple[torch.Tensor, list[int]]:
    """Every expand row, by (source rank, local expert, token): the order the sources' pair plans expect."""
    rows_from = torch.tensor(place.rows_from, device=place.pair_row.device)
    src_of_row = torch.repeat_interleave(torch.arange(num_ranks, device=rows_from.device), rows_from)
    src = src_of_row[place.pair_row]
    expert = place.slots[place.pair_row, place.pair_slot].long()
    order = torch.argsort(src * num_local + expert, stable=True)  # pairs are by (expert, source, token) already
    return place.pair_pos[order], torch.bincount(src, minlength=num_ranks).tolist()


def _slot_weights(weights: torch.Tensor, place: Placement, h: EPHandle, total: int) -> torch.Tensor:
    """`[total, K]` fp32: each received token's weight per slot for this rank's experts, 0 for the others."""
    if not h.do_expand:
        return weights[:total].masked_fill(place.slots < 0, 0.0)
    out = torch.zeros((total, h.num_topk), dtype=torch.float32, device=weights.device)
    out[place.pair_row, place.pair_slot] = weights[place.pair_pos]
    return out
