"""DeepEP V2's layouts on the Ascend ops (the ``ascend`` backend's ``expand`` calls, see its module docstring): one
``dispatch_v2`` whose ``expand_x`` and (source rank, token, slot) triples give both V2 layouts, placed exactly as
the reference backend places them (:mod:`deep_ep_npu.engine.expand`); one ``combine_v2`` with unit weights."""

from __future__ import annotations

from typing import Any

import torch

from ..core.call import ExpandCombine, ExpandDispatch
from ..engine import expand
from ..errors import invalid
from .ascend_ops import map_no_expert, pad_empty


def dispatch(backend: Any, c: ExpandDispatch) -> Any:
    """``c`` (an ``expand`` call) on ``backend``'s ops: :mod:`~deep_ep_npu.engine.expand`'s outputs, the handle in
    them."""
    if c.x_sf is not None:
        why = "the pre-quantized (float8_e4m3fn, sf) tuple has no Ascend A2/A3 dispatch op (quant_mode 0 takes bf16 / "
        raise invalid("x", why + "fp16 x): pass bf16 x, or use backend='reference'")
    e, h = c.experts, c.cached
    r, num_local, n, k, hidden = e.world_size, e.num_local, c.num_max, c.expert_ids.shape[1], c.x.shape[1]
    x, topk_idx = pad_empty(c.x, c.expert_ids)
    ids, zero_num = map_no_expert(topk_idx, e.num_moe_experts)
    extra: dict[str, Any] = dict(quant_mode=0, global_bs=n * r, zero_expert_num=zero_num, expert_token_nums_type=1)
    if c.expert_scales is not None:
        extra["expert_scales"] = pad_empty(c.expert_scales, c.expert_ids)[0]
    expand_x, _, assist, token_nums, ep_recv_counts, _, expand_scales = backend.ops.dispatch(
        x, ids, e.num_moe_experts, n, num_local, **extra
    )
    payload, sizes, token_ids = expand.Payload(c.x, None, k), expand.sizes_of(c, k), None
    state = dict(owner=backend, payload=payload)
    if h is None and sizes is not None and not (c.recv_rows or c.do_expand):  # fresh, worst case: no host read
        place, row, slot, out = _placed(c, payload, sizes, expand_x, assist, token_nums, expand_scales)
        out.handle = expand.new_handle(c, out, place, sizes, state)
        out.handle.state["placement"], num_pairs = place, expand_x.shape[0]
    else:
        if h is None:  # a fresh layout with exact shapes: read from the op's outputs (host reads)
            counts = token_nums[:num_local].long()
            num_pairs = int(counts.sum())
            src, token, slot = assist.view(-1)[: 3 * num_pairs].view(num_pairs, 3).long().unbind(1)
            expert = torch.repeat_interleave(torch.arange(num_local, device=x.device), counts, output_size=num_pairs)
            keys, row = torch.unique(src * n + token, sorted=True, return_inverse=True)  # tokens by (source, token)
            slots = torch.full((keys.numel(), k), -1, dtype=torch.int32, device=x.device)
            slots[row, slot] = expert.to(torch.int32)
            rows_from = torch.bincount(keys // n, minlength=r).tolist()
            place = expand.make_placement(slots, rows_from, num_local, c.alignment, sizes)
            token_ids = (keys % n).to(torch.int32)
        else:  # a cached one: every rank's op places the rows as the handle's dispatch did (no host read)
            place, (num_pairs, row, slot) = (
                h.state["placement"],
                (h.state["op"][key] for key in ("pairs", "row", "slot")),
            )
        num_rows = place.slots.shape[0]  # (row num_rows: where a worst-case layout's unused op rows land)
        x_rows = expand_x.new_empty((num_rows + 1, hidden))
        x_rows[row] = expand_x[:num_pairs]  # every copy of a token holds the same row
        weights = torch.zeros((num_rows + 1, k), dtype=torch.float32, device=x.device)
        if c.expert_scales is not None:
            weights[row, slot] = expand_scales[:num_pairs].float()  # this rank's slots only (0 elsewhere)
        make_handle = lambda out, place: expand.new_handle(c, out, place, sizes, state)  # noqa: E731
        rows = (x_rows[:num_rows], None, weights[:num_rows], token_ids, None, make_handle)
        out = expand.receive(c, payload, place, *rows)
    assert out.handle is not None
    sent = (ids, assist, ep_recv_counts)  # the op's combine arguments of these rows
    op = dict(sent=sent, zero_num=zero_num, row=row, slot=slot, pairs=num_pairs, num_op_rows=expand_x.shape[0])
    out.handle.state["op"] = op
    return out


def _placed(
    c: ExpandDispatch,
    payload: expand.Payload,
    sizes: tuple[int, int],
    expand_x: torch.Tensor,
    assist: torch.Tensor,
    token_nums: torch.Tensor,
    expand_scales: torch.Tensor,
) -> Any:
    """A fresh non-expand layout at the worst-case shapes (``sizes``) from the op's outputs, with index tensors (no
    host read): (placement, each op row's received row `[A]` (``R * N``: not a received pair) and slot, the
    outputs)."""
    e, k, a = c.experts, c.expert_ids.shape[1], c.alignment
    r, nl, n, dev, num_op_rows = e.world_size, e.num_local, c.num_max, expand_x.device, expand_x.shape[0]
    rn, at = r * n, torch.arange(expand_x.shape[0], device=expand_x.device)
    counts = token_nums[:nl].long()  # pairs per local expert; op rows by expert, then (source, token)
    src, token, slot = assist.view(-1)[: 3 * num_op_rows].view(num_op_rows, 3).long().unbind(1)
    valid, expert = at < counts.sum(), torch.searchsorted(counts.cumsum(0), at, right=True).clamp(max=nl - 1)
    key = torch.where(valid, src * n + token, rn)
    marks = torch.zeros((rn + 1,), dtype=torch.int64, device=dev).scatter_(0, key, 1)[:rn]  # (source, token) here
    first = marks.cumsum(0) - marks  # each received token's row: by source, then token
    row = torch.where(valid, first[key.clamp(max=rn - 1)], rn)
    table = torch.full((rn + 1, k), -1, dtype=torch.int32, device=dev)
    table[row, slot] = expert.to(torch.int32)
    key_of_row = torch.full((rn + 1,), -1, dtype=torch.int64, device=dev)
    key_of_row[torch.where(marks > 0, first, rn)] = torch.arange(rn, device=dev)
    key_of_row = key_of_row[:rn]
    out = expand.Outputs(c, payload, *sizes, None)
    x_rows = expand_x.new_empty((rn + 1, expand_x.shape[1]))
    x_rows[row] = expand_x
    out.x.copy_(x_rows[:rn])
    if c.expert_scales is not None:
        weights = torch.zeros((rn + 1, k), dtype=torch.float32, device=dev)
        weights[row, slot] = expand_scales[:num_op_rows].float()
        out.weights.copy_(weights[:rn])
    assert out.topk_idx is not None
    out.topk_idx.copy_(table[:rn])
    out.metadata[:, 0] = key_of_row.to(torch.int32)
    out.metadata[:, 1] = torch.where(key_of_row >= 0, key_of_row // n, -1).to(torch.int32)
    aligned = (counts + a - 1) // a * a
    out.psum_per_rank.copy_(marks.view(r, n).sum(dim=1).cumsum(0))
    out.psum_per_expert.copy_(aligned.cumsum(0))
    out.counts.copy_(counts)
    if c.recv_stats is not None:
        c.recv_stats.add_(counts.to(c.recv_stats.dtype))
    empty = torch.empty((0,), dtype=torch.int64, device=dev)  # (the expand layout's pairs: none)
    place = expand.Placement([], table[:rn], empty, empty, empty, counts, aligned, rn, sizes[1])
    return place, row, slot, out


def combine(backend: Any, c: ExpandCombine) -> torch.Tensor:
    """``c`` (an ``expand`` call) on ``backend``'s ops: `[T, hidden]`."""
    if c.expert_scales is not None:
        why = "no Ascend combine op carries per-slot values back (no combined_topk_weights)"
        raise invalid("topk_weights", why + ": pass None, or use backend='reference'")
    if len(c.bias) > 1:
        why = "the Ascend combine adds one shared_expert_x: pass one bias (their sum)"
        raise invalid("bias", why + ", or use backend='reference'")
    h, x = c.handle, c.x
    op, place = h.state["op"], h.state["placement"]
    k, meta, (row, slot) = h.num_topk, h.recv_src_metadata, (op["row"], op["slot"])
    rows = torch.zeros((op["num_op_rows"], x.shape[1]), dtype=x.dtype, device=x.device)
    if h.do_expand and not c.multiple_reduction:  # every expand row, in its own slot
        rows[: row.numel()] = x.index_select(0, meta[row, 2 + slot].long())
    else:  # one row per (token, rank), in the slot of its last expert here
        partial = expand.reduce_expanded(x, meta[:, 2:]) if h.do_expand else x
        partial = torch.cat([partial, partial.new_zeros((1, x.shape[1]))])  # (last row: unused op rows')
        last = torch.where(place.slots >= 0, torch.arange(k, device=x.device), -1).amax(dim=1)
        is_last = (slot == torch.cat([last, last.new_full((1,), -1)])[row]).unsqueeze(1)
        rows[: row.numel()] = torch.where(is_last, partial.index_select(0, row), 0)
    ones = torch.ones((max(h.num_tokens, 1), k), dtype=torch.float32, device=x.device)
    shared = pad_empty(c.bias[0], h.topk_idx)[0] if c.bias else None
    global_bs = h.num_max_tokens_per_rank * backend.num_ranks
    args = (rows, *op["sent"], ones, h.num_experts)
    out = backend.ops.combine(*args, global_bs=global_bs, zero_expert_num=op["zero_num"], shared_expert_x=shared)
    return out[: h.num_tokens]
