"""The masked layout (:mod:`.masked`, DeepEP's ``Buffer.low_latency_dispatch`` / ``low_latency_combine``) without a
host read, on the collective transport's static round (:mod:`deep_ep_npu.transports.static`): what the Buffer takes
instead of the engine's exchange when :func:`.masked.static_round` says so (values unchecked, the torch code a device
takes, the collective transport, no shrink mode, no LogFMT). Every message has a size known from the shapes alone, so
it runs on gloo and on NCCL / HCCL's exact-size all-to-all alike, and a graph can capture it.

Dispatch: every rank sends every rank its N (``num_max_dispatch_tokens_per_rank``) rows at fixed offsets, row t token t
(data and scales encoded once), each row's slot table naming the receiver's local expert per top-k slot (-1: none;
tokens past T and pairs of masked ranks: none), and the header inside the message. The receiver counts the pairs per
(local expert, source) as tensors and places them into the static ``recv_x`` `[L, R * N, H]` as :mod:`.masked` does
(this rank's block first, then the sources in rank order, tokens ascending); the unused pairs land in one spare row
past the buffers' ends. Combine: every rank returns every source ``N * min(K, L)`` rows at fixed offsets, the row of
token t's j-th expert on this rank (by id) at ``t * min(K, L) + j``, found from the handle alone, with every rank's
rows returned and pairs dispatched per rank in the header (a mismatched handle raises on every rank); the source sums
each token's rows in :mod:`.reduce`'s order (own experts first, then by rank; ``slot_order``: slots ascending) in fp32.
Results are bit-identical to :mod:`.masked`'s. Needs the same ``num_topk`` on every rank (checked: it sizes combine)."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..backends import InFlight
from ..core.call import MaskedCombine, MaskedDispatch
from ..handle import LowLatencyHandle
from ..quant import pack_ue8m0
from ..transports import static
from ..transports.agreement import Agreement
from .exchange import check_names, check_status, header
from .masked import COMBINE_NAMES, MISMATCH, NAMES
from .rows import DTYPE_CODES, RowFormat, row_format
from .static_flat import check_returns, inconsistent_returns

TOPK_NAMES = (*COMBINE_NAMES, "num_topk")


@functools.lru_cache(maxsize=32)
def _grid(r: int, n: int, k: int, me: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per shape, what does not depend on values: source `[R, 1, 1]`, token `[1, N, 1]` int64, token `[R, N, K]`
    int32, the sources in block order (this rank first) `[R]`."""
    src, tok = torch.arange(r, device=device).view(r, 1, 1), torch.arange(n, device=device).view(1, n, 1)
    return src, tok, tok.expand(r, n, k).to(torch.int32), _order(r, me, device)


@functools.lru_cache(maxsize=32)
def _order(r: int, me: int, device: torch.device) -> torch.Tensor:
    """`[R]` int64: the sources in the order of their blocks in each expert's rows (this rank first)."""
    return torch.tensor([me, *(s for s in range(r) if s != me)], device=device)


_MASKS: weakref.WeakKeyDictionary[Any, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def _mask(engine: Any, device: torch.device) -> torch.Tensor:
    """The buffer's rank mask `[R]` on ``device`` (copied again only after it changed in place)."""
    mask = engine.mask
    if mask.device == device:
        return mask
    held = _MASKS.get(engine)
    if held is None or held[0] != mask._version or held[1].device != device:
        held = _MASKS[engine] = (mask._version, mask.to(device))
    return held[1]


def _fmt(c: MaskedDispatch) -> RowFormat:
    return row_format(c.x.shape[1], c.x.dtype, c.quant, c.expert_ids.shape[1], False)


def dispatch_bytes(c: MaskedDispatch) -> int:
    """The rows' bytes of one dispatch message (the header aside)."""
    return c.num_max * _fmt(c).row_bytes


def combine_bytes(c: MaskedCombine) -> int:
    """The rows' bytes of one combine message (the header aside)."""
    h = c.handle
    rows = h.num_max_dispatch_tokens_per_rank * min(c.expert_ids.shape[1], h.src_info.shape[0])
    return rows * h.hidden * (2 if c.zero_copy else c.x.element_size())


def _sent(c: MaskedDispatch | MaskedCombine, mask: torch.Tensor, nl: int, me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, K]` bool: the pairs that travel (an expert, on a rank not masked, from a rank not masked), and `[T, K]`
    int64 each pair's destination rank (R where none)."""
    ids, r = c.expert_ids, mask.shape[0]
    dest = ids.clamp(min=0) // nl
    sent = (ids >= 0) & (mask[dest] == 0) & (mask[me] == 0)
    return sent, torch.where(sent, dest, r)


def dispatch(engine: Any, c: MaskedDispatch) -> InFlight:
    """The masked dispatch ``c`` (checked by :func:`~deep_ep_npu.core.rules.dispatch`) on ``engine``'s collective
    transport; the InFlight's value: ``(recv_x, recv_count, handle)`` as :class:`.masked._Masked`'s result."""
    e, x, q, dev = c.experts, c.x, c.quant, c.x.device
    r, nl, n, me, (t, k), hidden = e.world_size, e.num_local, c.num_max, e.rank, c.expert_ids.shape, x.shape[1]
    engine.tag ^= 1  # (the engine's sets, as its exchange flips them)
    engine.device, fmt, mask = dev, _fmt(c), _mask(engine, dev)
    fp = (n, e.num_moe_experts, hidden, DTYPE_CODES[x.dtype], 0 if q is None else 1 if q.deepep else 2, fmt.row_bytes)
    shared = header(fmt.row_bytes, (), fp, r)
    sent, dest = _sent(c, mask, nl, me)
    src, tok, tok32, order = _grid(r, n, k, me, dev)
    table = torch.where(dest == src, c.expert_ids % nl, -1).to(torch.int32)  # [R, T, K]

    def write(out: torch.Tensor) -> None:  # [R, N, row_bytes]: token t in row t, then rows of no slot
        out[:, t:, fmt.slot_off : fmt.weight_off].view(torch.int32).fill_(-1)
        data = x if q is None else fmt.encode_tokens(x)[:, : fmt.scale_end]  # (data and scales, quantized once)
        rows = out[:, :t]
        rows[:, :, : data.shape[1] * data.element_size()].view(data.dtype).copy_(data.expand(r, *data.shape))
        rows[:, :, fmt.token_off : fmt.slot_off].view(torch.int32).copy_(tok32[:, :t, :1])
        rows[:, :, fmt.slot_off : fmt.weight_off].view(torch.int32).copy_(table)

    def explain(agreement: Agreement) -> None:
        check_status(agreement)
        check_names(agreement, engine.ep, NAMES, 1 + 2 * r)
        check_names(agreement, engine.ep, ("row size in bytes",), 0)

    care = static.care(len(shared) + static.VECTOR - 1, (), dev)
    engine.wire["dispatch"] = ([n * fmt.row_bytes] * r, 8 * (len(shared) + static.VECTOR - 1))  # (profiling)
    receive = static.send(engine.collective, c.op, n, shared, write, care, None, None, explain, dev)
    out = _outputs(engine, c, fmt)

    def finish() -> tuple[Any, torch.Tensor, LowLatencyHandle]:
        parts, wait_ns = receive()
        got = engine.scratch("static_rows", (r, n, fmt.row_bytes), torch.uint8)
        _place(c, fmt, torch.stack(parts, out=got), out, (src, tok, tok32, order))
        if c.recv_stats is not None:
            c.recv_stats.add_(out["recv_count"])
        if c.wait_stats is not None:
            c.wait_stats.add_(wait_ns)
        return result

    recv_x = out["recv_x"] if q is None else (out["recv_x"], out["scales"])
    handle = LowLatencyHandle(out["src_info"], out["layout_range"], n, hidden, e.num_moe_experts)
    result = (recv_x, out["recv_count"], handle)
    return InFlight(finish, result)


def _outputs(engine: Any, c: MaskedDispatch, fmt: RowFormat) -> dict[str, torch.Tensor]:
    """The dispatch's outputs in the engine's alternating result sets (:class:`.masked._Masked`'s), each flat one
    with a spare element past the end: the pairs that are not placed land there."""
    e, n, hidden = c.experts, c.num_max, c.x.shape[1]
    rows, nl = e.num_local * e.world_size * n, e.num_local
    name = f"dispatch_out{engine.result_set}_"
    engine.result_set ^= 1
    x = engine.reused(name + "x", ((rows + 1) * hidden,), fmt.data_dtype)
    out = dict(recv_x=x[: rows * hidden].view(nl, rows // nl, hidden), x_rows=x.view(torch.uint8).view(rows + 1, -1))
    if c.quant is not None:  # DeepEP's [L, groups, R * N], transposed: tokens have stride 1
        groups, scale_dtype = (hidden // 512, torch.int32) if c.quant.ue8m0 else (hidden // 128, torch.float32)
        flat = engine.reused(name + "scales", (rows * groups + 1,), scale_dtype)
        out.update(scales=flat[:-1].view(nl, groups, rows // nl).transpose(1, 2), scale_flat=flat)
    info = engine.reused(name + "src_info", (rows + 1,), torch.int32)
    out.update(src_info=info[:-1].view(nl, rows // nl), info_flat=info)
    out["layout_range"] = engine.reused(name + "layout_range", (nl, e.world_size), torch.int64)
    out["recv_count"] = engine.reused(name + "recv_count", (nl,), torch.int32)
    return out


def _place(
    c: MaskedDispatch, fmt: RowFormat, got: torch.Tensor, out: dict[str, torch.Tensor], grid: tuple[torch.Tensor, ...]
) -> None:
    """Place the rows ``got`` `[R, N, row_bytes]` (by source, then token) into ``out`` (:func:`_outputs`)."""
    (r, n, _), (nl, rn, _) = got.shape, out["recv_x"].shape
    src, tok, tok32, order = grid
    table = got[:, :, fmt.slot_off : fmt.weight_off].view(torch.int32)  # [R, N, K]
    valid, expert = table >= 0, table.clamp(min=0).long()
    key = (expert * r + src) * n + tok  # (local expert, source, token)
    marks = torch.zeros((nl * r * n + 1,), dtype=torch.int64, device=got.device)
    marks.scatter_(0, torch.where(valid, key, nl * r * n).view(-1), 1)
    marks = marks[:-1].view(nl, r, n)
    counts = marks.sum(dim=2)  # [L, R]
    before = (marks.cumsum(2) - marks).view(-1)  # the block's pairs of earlier tokens
    in_order = counts[:, order]  # (this rank's block first, then the sources in rank order)
    begin = torch.empty_like(counts)
    begin[:, order] = in_order.cumsum(1) - in_order
    row = begin[expert, src] + before[key.clamp(max=nl * r * n - 1)]
    pos = torch.where(valid, expert * rn + row, nl * rn)  # [R, N, K]: each pair's row of recv_x (nl * rn: none)
    data = got[:, :, : fmt.data_bytes].view(fmt.word).unsqueeze(2).expand(r, n, fmt.num_slots, -1)
    out["x_rows"].view(fmt.word).index_put_((pos,), data)
    out["info_flat"].index_put_((pos,), tok32)
    if c.quant is not None:
        s = got[:, :, fmt.scale_off : fmt.scale_end].view(torch.float32)  # [R, N, groups] (int8: [R, N, 1])
        s = pack_ue8m0(s) if c.quant.ue8m0 else s
        groups = out["scales"].shape[2]
        g = torch.arange(groups, device=got.device)
        at = (expert.unsqueeze(3) * groups + g) * rn + row.unsqueeze(3)
        at = torch.where(valid.unsqueeze(3), at, nl * rn * groups)
        out["scale_flat"].index_put_((at,), s.unsqueeze(2).expand(r, n, fmt.num_slots, groups))
    out["layout_range"].copy_((begin << 32) | counts)
    out["recv_count"].copy_(counts.sum(dim=1))


def _returns(h: LowLatencyHandle, mask: torch.Tensor, kp: int, me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From the handle alone: `[R * N * kp]` int64, the row of the flattened expert output `[L * R * N]` each return
    message row carries (source s, token t, its j-th expert here at ``(s * N + t) * kp + j``), and the rows returned
    to each source `[R]` int64 (none to masked sources)."""
    (nl, rn), n = h.src_info.shape, h.num_max_dispatch_tokens_per_rank
    r, dev = rn // n, h.src_info.device
    count, begin = h.recv_count_per_rank, h.recv_begin  # [L, R]
    count = torch.where(mask.view(1, r) == 0, count, 0)
    order = _order(r, me, dev)  # (the blocks' order: this rank's first)
    at = torch.arange(rn, device=dev).repeat(nl, 1)
    block = torch.searchsorted((begin + count)[:, order].contiguous(), at, right=True)  # [L, R * N]: its block
    source = order[block.clamp(max=r - 1)]
    expert = torch.arange(nl, device=dev).view(nl, 1)
    valid = (block < r) & (at >= begin[expert, source])
    key = torch.where(valid, (source * n + h.src_info.long().clamp(0, n - 1)) * nl + expert, r * n * nl)
    marks = torch.zeros((r * n * nl + 1,), dtype=torch.int64, device=dev).scatter_(0, key.view(-1), 1)[:-1]
    j = (marks.view(r * n, nl).cumsum(1) - marks.view(r * n, nl)).view(-1)[key.clamp(max=r * n * nl - 1)]
    slot = torch.where(valid & (j < kp), key // nl * kp + j, r * n * kp)
    index = torch.zeros((r * n * kp + 1,), dtype=torch.int64, device=dev)
    index.scatter_(0, slot.view(-1), torch.arange(nl * rn, device=dev))
    return index[:-1], count.sum(dim=0)


def combine(engine: Any, c: MaskedCombine) -> InFlight:
    """The masked combine ``c`` (checked by :func:`~deep_ep_npu.core.rules.combine`) on ``engine``'s collective
    transport; the InFlight's value: the combined x `[T, H]` in ``c.x``'s dtype (``c.out`` when given)."""
    e, h, ids, dev = c.experts, c.handle, c.expert_ids, c.x.device
    engine.tag ^= 1
    engine.device = dev
    (nl, rn), n, hidden, (t, k) = h.src_info.shape, h.num_max_dispatch_tokens_per_rank, h.hidden, ids.shape
    r, me = e.world_size, e.rank
    source = engine.scratch("zero_copy", (nl, rn, hidden), torch.bfloat16) if c.zero_copy else c.x
    kp, mask = min(k, nl), _mask(engine, dev)
    index, returned = _returns(h, mask, kp, me)
    sent, dest = _sent(c, mask, nl, me)
    dispatched = torch.zeros((r + 1,), dtype=torch.int64, device=dev)
    dispatched.scatter_add_(0, dest.view(-1), sent.view(-1).long())
    fp = (n, h.num_experts, hidden, DTYPE_CODES[source.dtype], k)
    shared = header(hidden * source.element_size(), [0] * 2 * r, fp, r)

    def write(out: torch.Tensor) -> None:  # [R, N * kp, row_bytes] (through reused scratch: no page faults)
        stage = engine.scratch("static_return", (r * n * kp, hidden), source.dtype)
        torch.index_select(source.reshape(nl * rn, hidden), 0, index, out=stage)
        out.view(source.dtype).copy_(stage.view(r, n * kp, hidden))

    def explain(agreement: Agreement) -> None:
        check_status(agreement)
        check_names(agreement, engine.ep, TOPK_NAMES, 1 + 2 * r)
        check_returns(agreement, r, MISMATCH)

    vector = torch.cat([returned, dispatched[:r]])
    care = static.care(len(shared) + static.VECTOR - 1, tuple(range(static.VECTOR, static.VECTOR + 2 * r)), dev)
    engine.wire["combine"] = ([n * kp * shared[0]] * r, 8 * (len(shared) + static.VECTOR - 1))
    receive = static.send(
        engine.collective, c.op, n * kp, shared, write, care, vector, inconsistent_returns(r), explain, dev
    )
    out = c.out if c.out is not None else source.new_empty((t, hidden))
    # each pair's place in its expert rank's message: token t's j-th expert there (ids ascending)
    same = sent.unsqueeze(1) & (dest.unsqueeze(1) == dest.unsqueeze(2)) & (ids.unsqueeze(1) < ids.unsqueeze(2))
    j = same.sum(dim=2)
    if c.slot_order:
        by = torch.arange(k, device=dev).expand(t, k)
    else:  # own experts first, then the remote ranks in rank order (experts ascending in each)
        by = torch.where(sent, torch.where(dest == me, ids - e.num_moe_experts, ids), 2 * e.num_moe_experts)
        by = by.argsort(dim=1, stable=True)
    dest, j, sent, w = (a.gather(1, by) for a in (dest, j, sent, c.expert_scales))
    tokens = torch.arange(t, device=dev).view(t, 1)
    at = torch.where(sent, (dest * n + tokens) * kp + j, r * n * kp).view(-1)  # [T * K]: its received row
    w = torch.where(sent, w, 0.0)  # (the pairs not sent: a zero row times 0)

    def finish() -> torch.Tensor:
        parts, wait_ns = receive()
        got = engine.scratch("static_got", (r * n * kp + 1, hidden), source.dtype)  # (the rows, then a zero row)
        torch.cat([p.view(source.dtype) for p in parts], out=got[:-1])
        got[-1].zero_()
        y = engine.scratch("static_y", (t * k, hidden), source.dtype)
        torch.index_select(got, 0, at, out=y)
        terms = engine.scratch("static_terms", (t, k, hidden), torch.float32)
        terms.copy_(y.view(t, k, hidden)).mul_(w.unsqueeze(2))  # [T, K, H] fp32
        acc = engine.scratch("static_acc", (t, hidden), torch.float32).zero_()
        for i in range(k):  # summed in :mod:`.reduce`'s order
            acc += terms[:, i]
        if c.wait_stats is not None:
            c.wait_stats.add_(wait_ns)
        return out.copy_(acc)

    return InFlight(finish, out)
