"""DeepEP V2's layouts on the Ascend ops (the ``ascend`` backend's ``expand`` calls, see its module docstring): one
``dispatch_v2`` whose ``expand_x`` and (source rank, token, slot) triples give both V2 layouts, placed exactly as
the reference backend places them (:mod:`deep_ep_npu.engine.expand`); one ``combine_v2`` with unit weights."""

from __future__ import annotations

from typing import Any

import torch

from ..core.call import CombineCall, DispatchCall
from ..engine import expand
from ..engine.plan import make_plan
from ..errors import invalid
from ..handle import EPHandle
from .ascend_ops import map_no_expert


def _pad_empty(rows: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if topk_idx.shape[0]:
        return rows, topk_idx
    return rows.new_zeros((1, rows.shape[1])), topk_idx.new_full((1, topk_idx.shape[1]), -1)


def dispatch(backend: Any, c: DispatchCall) -> expand.Outputs:
    """``c`` (an ``expand`` call) on ``backend``'s ops; its handle cached in the outputs."""
    e, h = c.experts, c.cached
    r, num_local, n, k, hidden = e.world_size, e.num_local, c.num_max, c.expert_ids.shape[1], c.x.shape[1]
    x, topk_idx = _pad_empty(c.x, c.expert_ids)
    ids, zero_num = map_no_expert(topk_idx, e.num_moe_experts)
    extra: dict[str, Any] = dict(quant_mode=0, global_bs=n * r, zero_expert_num=zero_num, expert_token_nums_type=1)
    if c.expert_scales is not None:
        extra["expert_scales"] = _pad_empty(c.expert_scales, c.expert_ids)[0]
    expand_x, _, assist, token_nums, ep_recv_counts, _, expand_scales = backend.ops.dispatch(
        x, ids, e.num_moe_experts, n, num_local, **extra
    )
    counts = token_nums[:num_local].long()
    num_pairs = int(counts.sum())
    src, token, slot = assist.view(-1)[: 3 * num_pairs].view(num_pairs, 3).long().unbind(1)
    expert = torch.repeat_interleave(torch.arange(num_local, device=counts.device), counts, output_size=num_pairs)
    keys, row = torch.unique(src * n + token, sorted=True, return_inverse=True)  # tokens by (source, token)
    slots = torch.full((keys.numel(), k), -1, dtype=torch.int32, device=counts.device)
    slots[row, slot] = expert.to(torch.int32)
    rows_from = torch.bincount(keys // n, minlength=r).tolist()
    payload = expand.payload_of(c.x, None, k)
    sizes = (h.num_recv_tokens, h.num_expanded_tokens) if h is not None else None
    if h is None and not c.cpu_sync:
        sizes = expand.worst_case_rows(r, n, k, num_local, c.alignment)
    place = h.state["placement"] if h is not None else expand.make_placement(slots, rows_from, num_local, c.alignment,
                                                                             sizes)  # fmt: skip
    out = expand.Outputs(c, payload, place.num_rows, place.num_expanded)
    x_rows = expand_x.new_empty((keys.numel(), hidden))
    x_rows[row] = expand_x[:num_pairs]  # every copy of a token holds the same row
    weights = torch.zeros((keys.numel(), k), dtype=torch.float32, device=counts.device)
    if c.expert_scales is not None:
        weights[row, slot] = expand_scales[:num_pairs].float()  # this rank's slots only (0 elsewhere)
    _fill(c, out, place, x_rows, weights, (keys % n).to(torch.int32), fresh=h is None)
    if c.recv_stats is not None:
        c.recv_stats += counts.to(torch.int32)
    op = dict(ids=ids, assist=assist, ep_recv_counts=ep_recv_counts, zero_num=zero_num, row=row, slot=slot,
              num_op_rows=expand_x.shape[0])  # fmt: skip
    out.handle = h if h is not None else _handle(backend, c, out, place, sizes)
    out.handle.state.update(op=op, placement=place)
    return out


def _fill(c: DispatchCall, out: expand.Outputs, place: expand.Placement, x: torch.Tensor, weights: torch.Tensor,
          tokens: torch.Tensor, fresh: bool) -> None:  # fmt: skip
    """Write the received tokens (in layout order) where ``place`` says, and a fresh layout's handle tensors."""
    if c.do_expand:
        out.x[place.pair_pos] = x.index_select(0, place.pair_row)
        out.weights[place.pair_pos] = weights[place.pair_row, place.pair_slot]
    else:
        out.x[: x.shape[0]], out.weights[: x.shape[0]] = x, weights
        assert out.topk_idx is not None
        out.topk_idx[: x.shape[0]] = place.slots
    if not fresh:
        return
    total, n, a = tokens.shape[0], c.num_max, c.alignment
    rows_from = torch.tensor(place.rows_from, device=tokens.device)
    src = torch.repeat_interleave(torch.arange(len(place.rows_from), device=tokens.device), rows_from,
                                  output_size=total).to(torch.int32)  # fmt: skip
    out.metadata[:total, 0], out.metadata[:total, 1] = src * n + tokens, src
    if c.do_expand:
        out.metadata[place.pair_row, 2 + place.pair_slot] = place.pair_pos.to(torch.int32)
    aligned = (place.counts + a - 1) // a * a
    psum = aligned.cumsum(0)
    out.psum_per_rank.copy_(rows_from.cumsum(0))
    out.psum_per_expert.copy_(psum - aligned + place.counts if c.do_expand else psum)
    out.counts.copy_(place.counts)


def _handle(backend: Any, c: DispatchCall, out: expand.Outputs, place: expand.Placement,
            sizes: tuple[int, int] | None) -> EPHandle:  # fmt: skip
    num_rows, num_expanded = sizes or (place.num_rows, place.num_expanded)
    a, e = c.alignment, c.experts
    listed = ((place.counts + a - 1) // a * a).tolist() if c.cpu_sync else []
    ids = c.expert_ids.long()
    token, slot = (ids >= 0).nonzero(as_tuple=True)
    ex = ids[token, slot]
    plan = make_plan(token, slot, ex // e.num_local, ex % e.num_local, num_tokens=len(ids), num_ranks=e.world_size,
                     rank=e.rank, num_local_experts=e.num_local, per_pair_rows=False)  # fmt: skip
    return EPHandle(
        c.do_expand, e.num_moe_experts, a, c.num_max, 0, c.expert_ids.clone() if c.handle_copy else c.expert_ids,
        num_rows, num_expanded if c.do_expand else 0, listed, out.psum_per_rank, out.psum_per_expert, out.counts,
        out.metadata, expand.slot_idx(plan, c.expert_ids, e.rank), dict(owner=backend, payload=expand.payload_of(
            c.x, None, c.expert_ids.shape[1])),
    )  # fmt: skip


def combine(backend: Any, c: CombineCall) -> torch.Tensor:
    """``c`` (an ``expand`` call) on ``backend``'s ops: `[T, hidden]`."""
    if c.expert_scales is not None:
        raise invalid("topk_weights", "no Ascend combine op carries per-slot values back (no "
                      "combined_topk_weights): pass None, or use backend='reference'")  # fmt: skip
    if c.shared_expert_x and len(c.shared_expert_x) > 1:
        raise invalid("bias", "the Ascend combine adds one shared_expert_x: pass one bias (their sum), or use "
                      "backend='reference'")  # fmt: skip
    h, x = c.handle, c.x
    op, place = h.state["op"], h.state["placement"]
    total, k = sum(place.rows_from), h.num_topk
    meta = h.recv_src_metadata[:total]
    row, slot = op["row"], op["slot"]
    rows = torch.zeros((op["num_op_rows"], x.shape[1]), dtype=x.dtype, device=x.device)
    if h.do_expand and not c.multiple_reduction:  # every expand row, in its own slot
        rows[: row.numel()] = x.index_select(0, meta[row, 2 + slot].long())
    else:  # one row per (token, rank), in the slot of its last expert here
        partial = expand.reduce_expanded(x, meta[:, 2:]) if h.do_expand else x[:total]
        last = torch.where(place.slots >= 0, torch.arange(k, device=x.device), -1).amax(dim=1)
        is_last = (slot == last[row]).unsqueeze(1)
        rows[: row.numel()] = torch.where(is_last, partial.index_select(0, row), 0)
    num_tokens = h.num_tokens
    ones = torch.ones((max(num_tokens, 1), k), dtype=torch.float32, device=x.device)
    extra: dict[str, Any] = {}
    if c.shared_expert_x:
        extra["shared_expert_x"] = _pad_empty(c.shared_expert_x[0], h.topk_idx)[0]
    return backend.ops.combine(rows, op["ids"], op["assist"], op["ep_recv_counts"], ones, h.num_experts,
                               global_bs=h.num_max_tokens_per_rank * backend.num_ranks, zero_expert_num=op["zero_num"],
                               **extra)[:num_tokens]  # fmt: skip
