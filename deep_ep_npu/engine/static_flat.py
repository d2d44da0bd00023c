"""The flat layout (:mod:`.flat`) without a host read: DeepEP's low-latency contract for the ``_v2`` / V3 ops on the
collective transport's static round (:mod:`deep_ep_npu.transports.static`), which the ops (:mod:`deep_ep_npu.ops.v2`)
take instead of the engine's exchange (:func:`.flat.static_round`) when the call's values are not checked
(:func:`~deep_ep_npu.core.rules.values_checked`) and its tensors take the torch code a device takes (CPU tensors with
``DEEP_EP_NPU_CPU_KERNELS=0``) on a gloo group, for routed experts only (no shared-expert ranks, elastic re-layout,
TP stage, smooth scales, copy / const experts or combine quantization: those take :mod:`.flat`). Not on device
tensors yet (the masked layout's :mod:`.static_masked` is: the static round posts exact sizes off gloo, and a rank
that rejects its input sends its status at the peers' size, :func:`~deep_ep_npu.transports.static.reject`).

Dispatch: every rank sends every rank its ``N`` (= ``global_bs / W``, else Bs) tokens at their static offsets, row t
token t, each row's slot table naming the receiver's local expert per top-k slot (-1: none), and the header inside the
message; the receiver places the pairs expert-major, then by source rank, then token, from counts it keeps as tensors
(static output shapes: the worst case A). Combine: each expert row goes back to its source at offset ``t * K + k``
(``assist_info_for_combine``'s triple), with every rank's rows returned and pairs dispatched per rank in the header
(a mismatched handle raises on every rank); the source sums its slots ascending in fp32 as :mod:`.reduce` does.
Results are bit-identical to :mod:`.flat`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..backends import InFlight
from ..core.call import FlatCombine, FlatDispatch
from ..errors import shape
from ..transports import static
from ..transports.agreement import Agreement
from .exchange import check_names, check_status, header
from .flat import COMBINE_NAMES, MISMATCH, NAMES, check_batch, combine_fingerprint, fingerprint
from .rows import RowFormat, row_format


def _sent(c: FlatDispatch | FlatCombine) -> torch.Tensor:
    """`[T, K]` bool: the pairs that travel (routed ids inside the active mask)."""
    ids, mask = c.expert_ids, c.x_active_mask
    sent = (ids >= 0) & (ids < c.experts.num_moe_experts)
    if mask is not None:
        sent &= mask.unsqueeze(1) if mask.dim() == 1 else mask
    return sent


def dispatch(engine: Any, c: FlatDispatch) -> InFlight:
    """The flat dispatch ``c`` (checked by :func:`~deep_ep_npu.core.ascend.dispatch`) on ``engine``'s collective
    transport; the InFlight's value: :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`'s 7 outputs."""
    e, x, q, dev = c.experts, c.x, c.quant, c.x.device
    r, (t, k), nl, n, a = e.world_size, c.expert_ids.shape, e.num_local, c.num_max or x.shape[0], c.capacity
    weights = c.expert_scales
    fmt = row_format(x.shape[1], x.dtype, q, k, weights is not None)
    shared = header(fmt.row_bytes, (), fingerprint(c, fmt), r)
    sent = _sent(c)
    to = torch.arange(r, device=dev).view(r, 1, 1)
    table = torch.where(sent & (c.expert_ids // nl == to), c.expert_ids % nl, -1).to(torch.int32)  # [R, T, K]

    def write(out: torch.Tensor) -> None:  # [R, N, row_bytes]: token t in row t, then rows of no slot
        out[:, t:, fmt.slot_off : fmt.weight_off].view(torch.int32).fill_(-1)
        src = x if q is None else fmt.encode_tokens(x)[:, : fmt.scale_end]  # (data and scales, quantized once)
        rows = out[:, :t]
        rows[:, :, : src.shape[1] * src.element_size()].view(src.dtype).copy_(src.expand(r, *src.shape))
        rows[:, :, fmt.token_off : fmt.slot_off].view(torch.int32).copy_(torch.arange(t, device=dev).view(1, t, 1))
        rows[:, :, fmt.slot_off : fmt.weight_off].view(torch.int32).copy_(table)
        if weights is not None:
            rows[:, :, fmt.weight_off : fmt.end].view(torch.float32).copy_(weights.expand(r, t, k))

    batch = 1 + 2 * r + len(NAMES)  # (the fingerprint's batch word, compared when global_bs is 0)
    care = static.care(len(shared) + static.VECTOR - 1, () if c.global_bs == 0 else (static.VECTOR - 1 + batch,), dev)

    def explain(agreement: Agreement) -> None:
        check_status(agreement)
        check_batch(c, engine.ep, agreement)
        check_names(agreement, engine.ep, NAMES, 1 + 2 * r)
        check_names(agreement, engine.ep, ("row size in bytes",), 0)

    receive = static.send(engine.collective, c.op, n, shared, write, care, None, None, explain, dev)
    bufs = _buffers(c, fmt, a)
    result = _results(c, bufs, fmt, a)

    def finish() -> tuple[torch.Tensor, ...]:
        parts, wait_ns = receive()
        counts = _place(c, fmt, torch.stack(parts), bufs)
        if c.wait_stats is not None:
            c.wait_stats.add_((counts.view(nl, r).sum(dim=0) > 0).to(torch.int64) * (wait_ns // 1000))
        return result

    return InFlight(finish, result)


def _buffers(c: FlatDispatch, fmt: RowFormat, a: int) -> dict[str, torch.Tensor]:
    """The outputs' buffers, zeros, each with a last row where the pairs that are not sent land."""
    e, dev = c.experts, c.x.device
    r, nl, (t, k), (width, scale_dtype) = e.world_size, e.num_local, c.expert_ids.shape, _scale_layout(c)
    extra = 2 * c.global_bs * k * (r // 8) if c.expert_scales is not None and e.platform != "a5" else 0
    zeros = lambda *shape_, dtype=torch.uint8: torch.zeros(shape_, dtype=dtype, device=dev)  # noqa: E731
    return dict(
        expand_x=zeros(a + 1, fmt.data_bytes),
        scales=zeros(a + 1, math.prod(width) * scale_dtype.itemsize),
        triples=zeros(a + 1, 3, dtype=torch.int32),
        assist=zeros(max(t * k, a * 128), dtype=torch.int32),
        token_nums=zeros(nl, dtype=torch.int64),
        recv_counts=zeros(r * nl + extra, dtype=torch.int32),
        tp_counts=zeros(e.tp_world_size, dtype=torch.int32),
        expand_scales=zeros(a + 1 if c.expert_scales is not None else 1, dtype=torch.float32),
    )


def _scale_layout(c: FlatDispatch) -> tuple[tuple[int, ...], torch.dtype]:
    """``dynamic_scales``' shape per row and dtype."""
    q = c.quant
    if q is not None:
        return tuple(q.scale_shape(c.x.shape[1])), q.scale_dtype
    return ((c.scales.shape[1],) if c.scales is not None and c.scales.shape[1] else ()), torch.float32


def _results(c: FlatDispatch, b: dict[str, torch.Tensor], fmt: RowFormat, a: int) -> tuple[torch.Tensor, ...]:
    """:func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`'s 7 outputs, views of the buffers ``b``."""
    width, scale_dtype = _scale_layout(c)
    scales = b["scales"][:a].view(scale_dtype).view(a, *width)
    x = b["expand_x"][:a].view(fmt.data_dtype)
    return x, scales, b["assist"], b["token_nums"], b["recv_counts"], b["tp_counts"], b["expand_scales"][:-1]


def _place(c: FlatDispatch, fmt: RowFormat, got: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Place the rows ``got`` `[R, N, row_bytes]` (by source, then token) into the buffers ``b``; returns the pairs
    per (local expert, source) `[L * R]` int64."""
    r, n, k, nl, dev = got.shape[0], got.shape[1], fmt.num_slots, c.experts.num_local, got.device
    a = b["expand_x"].shape[0] - 1
    table = got[:, :, fmt.slot_off : fmt.weight_off].view(torch.int32)  # [R, N, K]
    valid, expert = table >= 0, table.clamp(min=0).long()
    src, tok = torch.arange(r, device=dev).view(r, 1, 1), torch.arange(n, device=dev).view(1, n, 1)
    block = expert * r + src  # (local expert, source): the blocks of expand_x, in order
    counts = torch.zeros((nl * r,), dtype=torch.int64, device=dev)
    counts.scatter_add_(0, torch.where(valid, block, 0).view(-1), valid.view(-1).to(torch.int64))
    marks = torch.zeros((nl * r * n + 1,), dtype=torch.int64, device=dev)  # (block, token) pairs received
    marks.scatter_(0, torch.where(valid, block * n + tok, nl * r * n).view(-1), 1)
    marks = marks[:-1].view(nl * r, n)
    before = (marks.cumsum(1) - marks).view(-1)  # the block's pairs of earlier tokens
    first = counts.cumsum(0) - counts
    pos = torch.where(valid, first[block] + before[block * n + tok], a)  # [R, N, K]: each pair's row (a: none)
    rows = got.unsqueeze(2)  # (a row per used slot)
    b["expand_x"].index_put_((pos,), rows[..., : fmt.data_bytes])
    if c.quant is not None:
        b["scales"].index_put_((pos,), rows[..., fmt.scale_off : fmt.scale_end])
    slot = torch.arange(k, device=dev).view(1, 1, k)
    b["triples"].index_put_((pos,), torch.stack(torch.broadcast_tensors(src, tok, slot), dim=-1).to(torch.int32))
    b["assist"][: 3 * a] = b["triples"][:a].view(-1)
    if c.expert_scales is not None:
        b["expand_scales"].index_put_((pos,), got[:, :, fmt.weight_off : fmt.end].view(torch.float32))
    per_expert = counts.view(nl, r).sum(dim=1)
    b["token_nums"].copy_(per_expert.cumsum(0) if c.expert_token_nums_type == 0 else per_expert)
    b["recv_counts"][: nl * r] = counts.cumsum(0).to(torch.int32)
    b["tp_counts"].copy_(counts.sum().to(torch.int32).expand(b["tp_counts"].shape))
    return counts


def combine(engine: Any, c: FlatCombine) -> InFlight:
    """The flat combine ``c`` (checked by :func:`~deep_ep_npu.core.ascend.combine`) on ``engine``'s collective
    transport; the InFlight's value: x `[T, H]` in ``c.x``'s dtype."""
    e, x, dev = c.experts, c.x, c.x.device
    r, (t, k), nl, hidden = e.world_size, c.expert_ids.shape, e.num_local_here, x.shape[1]
    n = (c.global_bs // r or t) * k  # rows one source gets back: its tokens' pairs
    assist, counts = c.handle[0], c.handle[1]
    sent = _sent(c)
    dest = torch.where(sent, c.expert_ids // e.num_local, r)
    rows = min(x.shape[0], assist.numel() // 3)
    triple = assist[: 3 * rows].view(rows, 3).long()
    back = torch.arange(rows, device=dev) < counts[r * nl - 1]
    to = torch.where(back, triple[:, 0], r)
    returned = torch.zeros((r + 1,), dtype=torch.int64, device=dev).scatter_add_(0, to, torch.ones_like(to))[:r]
    dispatched = torch.zeros((r + 1,), dtype=torch.int64, device=dev)
    dispatched.scatter_add_(0, dest.view(-1), torch.ones_like(dest.view(-1)))
    row_bytes = hidden * x.element_size()
    shared = header(row_bytes, [0] * 2 * r, combine_fingerprint(c), r)

    def write(out: torch.Tensor) -> None:  # [R, n, row_bytes]: expert row of (t, k) at t * K + k of t's source
        stage = torch.empty((r * n + 1, hidden), dtype=x.dtype, device=dev)
        stage.index_put_((torch.where(back, triple[:, 0] * n + triple[:, 1] * k + triple[:, 2], r * n),), x[:rows])
        out.view(x.dtype).copy_(stage[:-1].view(r, n, hidden))

    def explain(agreement: Agreement) -> None:
        check_status(agreement)
        check_names(agreement, engine.ep, COMBINE_NAMES, 1 + 2 * r)
        check_returns(agreement, r, MISMATCH)

    vector = torch.cat([returned, dispatched[:r]])
    care = static.care(len(shared) + static.VECTOR - 1, tuple(range(static.VECTOR, static.VECTOR + 2 * r)), dev)
    inconsistent = inconsistent_returns(r)
    receive = static.send(engine.collective, c.op, n, shared, write, care, vector, inconsistent, explain, dev)
    out = c.out if c.out is not None else x.new_empty((t, hidden))

    def finish() -> torch.Tensor:
        parts, wait_ns = receive()
        y = torch.stack(parts).view(x.dtype)[dest.clamp(max=r - 1), torch.arange(t * k, device=dev).view(t, k)]
        acc = torch.zeros((t, hidden), dtype=torch.float32, device=dev)
        for j in range(k):  # slots ascending, in fp32 (as :mod:`.reduce`)
            acc += torch.where(sent[:, j : j + 1], y[:, j].float() * c.expert_scales[:, j : j + 1], 0.0)
        if c.shared_expert_x is not None:
            acc += c.shared_expert_x.float()
        if c.x_active_mask is not None and c.x_active_mask.dim() == 1:
            acc = torch.where(torch.arange(t, device=dev).view(t, 1) < c.x_active_mask.sum(), acc, 0.0)
        if c.wait_stats is not None:
            c.wait_stats.add_((dispatched[:r] > 0).to(torch.int64) * (wait_ns // 1000))
        return out.copy_(acc)

    return InFlight(finish, out)


def inconsistent_returns(r: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A combine's ``inconsistent(headers)`` for :func:`~deep_ep_npu.transports.static.send`: True where some rank p
    returns rank q another number of rows than q dispatched pairs to p (the vector words: R returned, R dispatched)."""

    def inconsistent(got: torch.Tensor) -> torch.Tensor:
        sends, expects = got[:, static.VECTOR : static.VECTOR + r], got[:, static.VECTOR + r : static.VECTOR + 2 * r]
        return (sends != expects.T).any()

    return inconsistent


def check_returns(agreement: Agreement, r: int, mismatch: tuple[str, str]) -> None:
    """Raise (the same error on every rank) naming the first rank pair whose returned rows and dispatched pairs
    disagree (the error path of :func:`inconsistent_returns`)."""
    sends = [fp[1 : 1 + r] for fp in agreement.shared]
    expects = [fp[1 + r : 1 + 2 * r] for fp in agreement.shared]
    if bad := [(p, q) for p in range(r) for q in range(r) if sends[p][q] != expects[q][p]]:
        (p, q), (param, hint) = bad[0], mismatch
        why = f"rank {p} would return {sends[p][q]} rows to rank {q}, which dispatched {expects[q][p]} pairs to it"
        raise shape(param, f"{why}; pass {hint} (mismatched rank pairs: {bad[:8]})")
