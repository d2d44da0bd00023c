"""DeepEP's masked layout (``Buffer.low_latency_dispatch`` / ``low_latency_combine``): each token goes once per
destination rank and is expanded into ``recv_x`` `[L, R * N, hidden]`; inside local expert i, source rank j owns rows
``[begin, begin + count)``: this rank's own block first (placed in the send phase), then the other sources in rank
order, tokens ascending. Results alternate between two sets of the buffer (DeepEP: hold at most 2 results).
Combine reduces in fp32 at the source: own experts first, then the remote ranks in rank order."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .. import kernels
from ..core.call import MaskedCombine, MaskedDispatch
from ..core.rules import values_checked
from ..errors import shape
from ..handle import LowLatencyHandle
from ..transports import static
from ..transports.agreement import Agreement
from .plan import plan_topk
from .reduce import LOGFMT, CombineJob
from .rows import DTYPE_CODES, Parts, parse, row_format

LOOP_BYTES = 1 << 18
"""Received data above which the layout is filled by one gather per expert instead of one scatter."""
NAMES = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype", "use_fp8 format", "row bytes")
COMBINE_NAMES, MISMATCH = NAMES[:4], ("handle", "the dispatch's handle and the same topk_idx")


def exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


class _Masked:
    """The layout of one dispatch (the :class:`.Layout` protocol); its outputs (``Buffer``'s), filled in
    place; the call's ``recv_stats`` `[L]` int32 and ``wait_stats`` `[R]` int64 (ns) accumulate."""

    known, vectors, agree_now, tp, weights, smooth, names = None, (), False, None, None, None, NAMES

    def __init__(self, c: MaskedDispatch, engine: Any) -> None:
        e, x, n = c.experts, c.x, c.num_max
        r, num_local, hidden = e.world_size, e.num_local, x.shape[1]
        self.c, self.rank, self.source = c, e.rank, x
        self.plan = plan_topk(c.expert_ids, num_local, r, e.rank, engine.mask, per_pair_rows=False)
        self.fmt = fmt = row_format(hidden, x.dtype, q := c.quant, c.expert_ids.shape[1], False)
        code = 0 if q is None else 1 if q.deepep else 2  # (the format: none, DeepEP's fp8, int8 per token)
        self.fingerprint = (n, e.num_moe_experts, hidden, DTYPE_CODES[x.dtype], code, fmt.row_bytes)
        out, reused = f"dispatch_out{engine.result_set}_", engine.reused  # the two alternating sets: no page faults
        engine.result_set ^= 1
        self.recv_x = reused(out + "x", (num_local, r * n, hidden), fmt.data_dtype)
        self.scales = None
        if q is not None:  # DeepEP allocates [L, groups, R * N] and transposes: tokens have stride 1
            groups, scale_dtype = (hidden // 512, torch.int32) if q.ue8m0 else (hidden // 128, torch.float32)
            self.scales = reused(out + "scales", (num_local, groups, r * n), scale_dtype).transpose(1, 2)
        self.src_info = reused(out + "src_info", (num_local, r * n), torch.int32)
        self.layout_range = reused(out + "layout_range", (num_local, r), torch.int64)
        self.recv_count = reused(out + "recv_count", (num_local,), torch.int32)
        self.handle = LowLatencyHandle(self.src_info, self.layout_range, n, hidden, e.num_moe_experts)
        self.counts_own: torch.Tensor | None = None

    def result(self) -> tuple[Any, torch.Tensor, LowLatencyHandle]:
        recv_x = self.recv_x if self.scales is None else (self.recv_x, self.scales)
        return recv_x, self.recv_count, self.handle

    def place_own(self, own_rows: torch.Tensor, encode: Any) -> None:
        """This rank's own pairs, straight from ``x`` where the kernels can (no packing), else from their rows."""
        plan, me, pairs = self.plan, self.rank, self.plan.own_pairs
        pos = torch.zeros(self.src_info.shape[0], dtype=torch.int64, device=self.source.device)
        counts = torch.zeros(self.layout_range.shape, dtype=torch.int64, device=pos.device)
        if self.fmt.quant is not None or not kernels.place_pairs(
            self.source, plan.token[pairs], plan.expert[pairs], self.recv_x, self.src_info, pos, counts, me
        ):
            encode()
            counts = self._write([(me, own_rows)], pos)
        self.counts_own = counts

    def place(self, parts: Parts, own: tuple[int, torch.Tensor], agreement: Agreement, wait_ns: int) -> None:
        assert self.counts_own is not None, "own rows are placed in the send phase"
        counts = self.counts_own + self._write(parts, self.counts_own.sum(dim=1))
        r, me = counts.shape[1], self.rank
        if not kernels.layout_range(counts, me, self.layout_range, self.recv_count):
            order = torch.tensor([me] + [s for s in range(r) if s != me], device=counts.device)
            begin = torch.empty_like(counts)
            begin[:, order] = exclusive_cumsum(counts[:, order], 1)
            self.layout_range.copy_((begin << 32) | counts)
            self.recv_count.copy_(counts.sum(dim=1))
        if self.c.recv_stats is not None:
            self.c.recv_stats.add_(self.recv_count)
        if self.c.wait_stats is not None:
            self.c.wait_stats.add_(wait_ns)

    def _write(self, parts: Parts, base: torch.Tensor) -> torch.Tensor:
        """Place the pairs of ``parts`` ((source, rows) in rank order) in each expert's rows from ``base[expert]``
        on; returns their counts `[L, R]` int64."""
        fmt, num_local, r = self.fmt, self.src_info.shape[0], self.layout_range.shape[1]
        counts = torch.zeros((num_local, r), dtype=torch.int64, device=base.device)
        pos, most = base.clone(), max((rows.shape[0] for _, rows in parts), default=0)
        pairs = torch.empty((2, max(most * fmt.num_slots, 1)), dtype=torch.int64, device=base.device)
        for src, rows in parts:
            k = kernels.place(
                rows,
                fmt.data_bytes,
                fmt.token_off,
                fmt.slot_off,
                fmt.num_slots,
                self.recv_x,
                self.src_info,
                pos,
                counts,
                src,
                pairs,
            )
            if k is None:
                self._write_torch(rows, src, pos, counts)
            elif self.scales is not None:
                row, flat, q = pairs[0, :k], pairs[1, :k], fmt.quant
                int8 = q is not None and not q.deepep
                if q is None or q.ue8m0 or not kernels.place_scales(rows, fmt.scale_off, row, flat, self.scales, int8):
                    self._write_scales(rows, row, flat)
        return counts

    def _write_torch(self, rows: torch.Tensor, src: int, pos: torch.Tensor, counts: torch.Tensor) -> None:
        """:meth:`_write` of one source in torch (where the kernels do not apply)."""
        fmt, (num_local, rn) = self.fmt, self.src_info.shape
        row, _, expert = parse(fmt, rows)
        if not row.numel():
            return
        order = torch.argsort(expert, stable=True)  # by expert; tokens ascend inside a source
        row, local = row[order], expert[order]
        per_expert = torch.bincount(local, minlength=num_local)
        at = pos[local] + torch.arange(local.numel(), device=row.device) - exclusive_cumsum(per_expert)[local]
        flat = local * rn + at
        if row.numel() * fmt.data_bytes < LOOP_BYTES:  # small: one scatter beats a call per expert
            fmt.scatter_data(rows, row, self.recv_x.view(num_local * rn, -1), flat)
        else:  # large: expert i's rows are one contiguous range, gathered in one pass each
            for i, (mine, b) in enumerate(zip(row.split(per_expert.tolist()), pos.tolist(), strict=True)):
                if mine.numel():
                    fmt.gather_data(rows, mine, self.recv_x[i, b : b + mine.numel()])
        self._write_scales(rows, row, flat)
        self.src_info.view(-1)[flat] = fmt.tokens(rows)[row]
        counts[:, src] += per_expert
        pos += per_expert

    def _write_scales(self, rows: torch.Tensor, row: torch.Tensor, flat: torch.Tensor) -> None:
        if self.scales is None:
            return
        rn, fmt = self.src_info.shape[1], self.fmt
        s, fp8 = fmt.scales(rows, row), fmt.quant is not None and fmt.quant.deepep
        self.scales[flat // rn, flat % rn] = s if fp8 else s.expand(-1, self.scales.shape[2])


layout = _Masked


def _add_wait(stats: torch.Tensor, agreement: Agreement, wait_ns: int) -> None:
    stats.add_(wait_ns)


def return_rows(handle: LowLatencyHandle, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Rows of the flattened `[L * R * N]` expert output to send back, by (source, expert, row), and rows per source
    (none to masked sources)."""
    (num_local, r), n = handle.layout_range.shape, handle.num_max_dispatch_tokens_per_rank
    outside = f"holds a block outside [0, R * N = {r * n}); pass dispatch's handle"
    if isinstance(fast := kernels.return_rows(handle.layout_range, n, mask), tuple):
        return fast
    if fast is not None:
        raise shape("handle.layout_range", f"{outside} (block {divmod(fast, r)})")
    count, begin = handle.recv_count_per_rank, handle.recv_begin
    if bool(((begin < 0) | (begin + count > r * n)).any()):
        raise shape("handle.layout_range", outside)
    if bool(mask.any()):
        count = count.masked_fill(mask.to(count.device).bool().unsqueeze(0), 0)
    count_t = count.t().reshape(-1)
    start_t = (begin + torch.arange(num_local, device=begin.device).unsqueeze(1) * (r * n)).t().reshape(-1)
    total = int(count_t.sum())
    rows = torch.repeat_interleave(start_t - exclusive_cumsum(count_t), count_t, output_size=total)
    return rows + torch.arange(total, device=rows.device), count.sum(dim=0).tolist()


def combine_jobs(c: MaskedCombine, engine: Any) -> list[CombineJob]:
    """The combine of a masked dispatch's rows (``c.x``, or with ``zero_copy`` the buffer's combine buffer)."""
    h, e = c.handle, c.experts
    (num_local, rn), hidden = h.src_info.shape, h.hidden
    rows, rows_per_src = return_rows(h, engine.mask)
    plan = plan_topk(c.expert_ids, num_local, e.world_size, e.rank, engine.mask, per_pair_rows=True)
    source = engine.scratch("zero_copy", (num_local, rn, hidden), torch.bfloat16) if c.zero_copy else c.x
    out = c.out if c.out is not None else source.new_empty((c.expert_ids.shape[0], hidden))
    weights, wire, stats = c.expert_scales[plan.token, plan.slot], LOGFMT if c.logfmt else 0, c.wait_stats
    fingerprint = (h.num_max_dispatch_tokens_per_rank, h.num_experts, hidden, DTYPE_CODES[c.x.dtype])
    capacity = h.num_max_dispatch_tokens_per_rank * min(c.expert_ids.shape[1], num_local)  # (per source: N tokens)
    return [
        CombineJob(
            source.view(num_local * rn, hidden),
            rows,
            rows_per_src,
            plan,
            weights,
            wire,
            out,
            fingerprint,
            COMBINE_NAMES,
            MISMATCH,
            by_slot=c.slot_order,
            on_wait=None if stats is None else partial(_add_wait, stats),
            capacity=capacity,
        )
    ]


def static_round(backend: Any, c: MaskedDispatch | MaskedCombine, message_bytes: Any) -> bool:
    """Whether the masked call ``c`` takes the static round of :mod:`.static_masked` (see there) on ``backend``: the
    reference engine, values unchecked, the torch code a device takes (a device's group, or CPU tensors with the
    kernels off on gloo), the collective transport, no shrink mode nor LogFMT, messages of whole int64 words, and
    (gloo) each within the bound its receives are posted at (``message_bytes(c)``: its rows' bytes)."""
    if backend.name != "reference" or values_checked(c.x) or backend.ep.enable_shrink:
        return False
    coll, dev = backend.collective, c.x.device
    if dev.type != backend.ep.device.type or dev.type == "cpu" and kernels.library() is not None:
        return False
    if backend.transport_for(dev) is not coll or isinstance(c, MaskedCombine) and c.logfmt:
        return False
    rows = message_bytes(c)
    return rows % 8 == 0 and static.fits(coll, rows, 1 + 2 * backend.num_ranks + 16)  # (header(): 16 words)
