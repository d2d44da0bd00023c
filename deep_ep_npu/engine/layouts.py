"""Where received rows go: DeepEP's masked layout and Ascend's flat expert-major layout.

Both are placements of the same received pairs (:class:`~.dispatch.Received`), computed from the pairs' (local
expert, source rank) and written once. For combine, each layout also says where the rows of each source rank sit
(:meth:`Masked.return_rows` / :meth:`Flat.return_rows`), in the order the source's plan expects them back: by
source rank, then local expert, then token.
"""

from __future__ import annotations

import torch

from ..errors import shape
from ..group import Agreement
from ..params import ValidDispatch
from .dispatch import Received
from .rows import RowFormat
from .tp import tp_gather_rows

LOOP_BYTES = 1 << 22
"""Received data above which the masked layout is filled by one gather per expert instead of one scatter."""


def exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


def _block_positions(expert: torch.Tensor, src: torch.Tensor, num_local: int, r: int, base: torch.Tensor):
    """Sort pairs by (expert, source) (stable) and give each its position inside its expert's rows, starting at
    ``base[expert]``. Returns (order, position, counts `[L, R]` int64)."""
    order = torch.argsort(expert * r + src, stable=True)
    expert, src = expert[order], src[order]
    counts = torch.bincount(expert * r + src, minlength=num_local * r).view(num_local, r)
    start = exclusive_cumsum(counts.sum(dim=1))
    pos = torch.arange(order.numel(), device=expert.device) - start[expert] + base[expert]
    return order, pos, counts


class Masked:
    """DeepEP's layout. Outputs, filled in place: ``recv_x`` `[L, R * N, hidden]` (``fmt.data_dtype``), ``scales``
    `[L, R * N, G]` (fp32, or int32 UE8M0) or None, ``src_info`` `[L, R * N]` int32, ``layout_range`` `[L, R]` int64
    ``(begin << 32) | count``, ``recv_count`` `[L]` int32; ``recv_stats`` `[L]` int32 and ``wait_stats`` `[R]`
    int64 (ns) accumulate. Inside expert i, this rank's own block comes first, then the other sources by rank."""

    names = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype", "use_fp8 format", "row bytes")

    def __init__(self, rank, recv_x, scales, src_info, layout_range, recv_count, use_ue8m0, recv_stats, wait_stats):
        self.rank, self.recv_x, self.scales, self.src_info = rank, recv_x, scales, src_info
        self.layout_range, self.recv_count, self.use_ue8m0 = layout_range, recv_count, use_ue8m0
        self.recv_stats, self.wait_stats = recv_stats, wait_stats
        self.counts_own: torch.Tensor | None = None

    def check(self, agreement: Agreement) -> None:
        agreement.check(self.rank, self.names)

    def _write(self, fmt: RowFormat, rows: torch.Tensor, got: Received, base: torch.Tensor) -> torch.Tensor:
        num_local, rn = self.src_info.shape
        order, pos, counts = _block_positions(got.expert, got.src, num_local, self.layout_range.shape[1], base)
        row, local = got.row[order], got.expert[order]
        flat = local * rn + pos
        if row.numel() == 0:
            return counts
        if row.numel() * fmt.data_bytes < LOOP_BYTES:  # small: one scatter beats a call per expert
            fmt.scatter_data(rows, row, self.recv_x.view(num_local * rn, -1), flat)
        else:  # large: expert i's rows are one contiguous range, gathered in one pass each
            begin = 0
            for i, (count, b) in enumerate(zip(counts.sum(dim=1).tolist(), base.tolist(), strict=True)):
                if count:
                    fmt.gather_data(rows, row[begin : begin + count], self.recv_x[i, b : b + count])
                begin += count
        if self.scales is not None:
            s = fmt.scales(rows, row, self.use_ue8m0)
            self.scales[local, pos] = s if fmt.quant == "fp8_e4m3" else s.expand(-1, self.scales.shape[2])
        self.src_info.view(-1)[flat] = fmt.tokens(rows)[row]
        return counts

    def place_own(self, fmt: RowFormat, rows: torch.Tensor, got: Received) -> None:
        zero = torch.zeros(self.src_info.shape[0], dtype=torch.int64, device=rows.device)
        self.counts_own = self._write(fmt, rows, got, zero)

    def place_remote(self, fmt, rows, got, own_rows, own, agreement: Agreement, wait_ns: int) -> None:
        assert self.counts_own is not None
        counts = self.counts_own + self._write(fmt, rows, got, self.counts_own.sum(dim=1))
        r, me = counts.shape[1], self.rank
        order = torch.tensor([me] + [s for s in range(r) if s != me], device=counts.device)
        begin = torch.empty_like(counts)
        begin[:, order] = exclusive_cumsum(counts[:, order], 1)
        self.layout_range.copy_((begin << 32) | counts)
        self.recv_count.copy_(counts.sum(dim=1))
        if self.recv_stats is not None:
            self.recv_stats += self.recv_count
        if self.wait_stats is not None:
            self.wait_stats += wait_ns

    @staticmethod
    def return_rows(layout_range: torch.Tensor, n: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows of the flattened `[L * R * N]` expert output to send back, by (source, expert, row), and rows per
        source (none to masked sources)."""
        num_local, r = layout_range.shape
        count, begin = layout_range & 0xFFFFFFFF, layout_range >> 32
        if bool(((begin < 0) | (begin + count > r * n)).any()):
            raise shape("handle.layout_range", f"holds a block outside [0, R * N = {r * n}); pass dispatch's handle")
        if bool(mask.any()):
            count = count.masked_fill(mask.to(count.device).bool().unsqueeze(0), 0)
        count_t = count.t().reshape(-1)
        start_t = (begin + torch.arange(num_local, device=begin.device).unsqueeze(1) * (r * n)).t().reshape(-1)
        total = int(count_t.sum())
        rows = torch.repeat_interleave(start_t - exclusive_cumsum(count_t), count_t, output_size=total)
        return rows + torch.arange(total, device=rows.device), count.sum(dim=0).tolist()


class Flat:
    """Ascend's layout: the 7 outputs of ``npu_moe_distribute_dispatch_v2`` (see :mod:`deep_ep_npu.ops`), filled by
    :meth:`place_remote` into :attr:`outputs`. With a TP pair (``tp``), the TP peer's rows follow this rank's own."""

    names = (
        "moe_expert_num", "hidden", "topk", "quant_mode", "global_bs", "row_bytes", "x dtype", "shared_expert_num",
        "shared_expert_rank_num", "elastic_info", "tp_world_size",
    )  # fmt: skip

    def __init__(self, v: ValidDispatch, weights: bool) -> None:
        layout = v.layout
        self.rank, self.num_ranks, self.num_local, self.x, self.topk = (
            layout.rank, layout.world_size, layout.num_local_experts_here, v.x, v.topk
        )  # fmt: skip
        self.capacity = layout.recv_capacity(v.global_bs_real, v.topk)
        self.quant, self.scales_width = v.quant, 0 if v.scales is None else v.scales.shape[1]
        self.expert_token_nums_type, self.weights, self.global_bs = v.expert_token_nums_type, weights, v.global_bs
        self.performance_info, self.tp_world_size = v.performance_info, layout.tp_world_size
        self.tp = (layout.tp, layout.tp_rank_id) if layout.tp is not None else None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def check(self, agreement: Agreement) -> None:
        agreement.check(self.rank, ())
        batch = [fp[-1] for fp in agreement.shared]
        if self.global_bs == 0 and len(set(batch)) > 1:
            raise shape(
                "global_bs",
                f"is 0 but x has different batch sizes across ranks (per rank: {batch}); pass global_bs = max(Bs) * W",
            )
        agreement.check(self.rank, self.names)

    def place_own(self, fmt: RowFormat, rows: torch.Tensor, got: Received) -> None:
        del fmt, rows, got  # placed with the remote rows: their positions depend on every source's counts

    def place_remote(self, fmt, rows, got, own_rows, own, agreement: Agreement, wait_ns: int) -> None:
        dev, w, num_local = self.x.device, self.num_ranks, self.num_local
        tp = 2 if self.tp is not None else 1
        expert, src = torch.cat([got.expert, own.expert]), torch.cat([got.src, own.src])
        num_recv = int(expert.numel())
        if num_recv > self.capacity:
            raise shape("expert_ids", f"this rank received {num_recv} rows but can hold A = {self.capacity}")
        order = torch.argsort(expert * w + src, stable=True)
        counts = torch.bincount(expert * w + src, minlength=num_local * w).view(num_local, w)
        position = torch.empty_like(order)
        position[order] = torch.arange(num_recv, device=dev)  # final row of each pair (remote pairs first, then own)
        cap = self.capacity * tp
        hidden = self.x.shape[1]
        expand_x = torch.zeros((cap, hidden), dtype=fmt.data_dtype, device=dev)
        width = () if self.quant or not self.scales_width else (self.scales_width,)
        dynamic_scales = torch.zeros((cap, *width), dtype=torch.float32, device=dev)
        assist = torch.zeros((max(self.x.shape[0] * self.topk, self.capacity * 128),), dtype=torch.int32, device=dev)
        expand_scales = torch.zeros((self.capacity if self.weights else 0,), dtype=torch.float32, device=dev)
        n_remote = got.row.numel()
        for buf, part, at in ((rows, got, position[:n_remote]), (own_rows, own, position[n_remote:])):
            if not at.numel():
                continue
            fmt.scatter_data(buf, part.row, expand_x, at)
            if self.quant:
                dynamic_scales[at] = fmt.scales(buf, part.row)[:, 0]
            triples = torch.stack([part.src, fmt.tokens(buf)[part.row].long(), part.slot], dim=1)
            assist.view(-1)[: 3 * self.capacity].view(-1, 3)[at] = triples.to(torch.int32)
            if self.weights:
                expand_scales[at] = fmt.weights(buf)[part.row, part.slot]
        all_counts = counts.reshape(-1)
        tp_recv_counts = torch.full((self.tp_world_size,), num_recv, dtype=torch.int32, device=dev)
        if self.tp is not None:
            tp_ep, tp_rank = self.tp
            peer_counts, num_peer = tp_gather_rows(tp_ep, tp_rank, expand_x, dynamic_scales, num_recv, all_counts)
            tp_recv_counts[1 - tp_rank] = num_peer
            all_counts = torch.cat([all_counts, peer_counts])
        per_expert = all_counts.view(tp, num_local, w).sum(dim=(0, 2))
        kind = self.expert_token_nums_type
        expert_token_nums = (per_expert.cumsum(0) if kind == 0 else per_expert).to(torch.int64)
        extra = 2 * self.global_bs * self.topk * (w // 8) if self.weights else 0
        ep_recv_counts = torch.zeros((all_counts.numel() + extra,), dtype=torch.int32, device=dev)
        ep_recv_counts[: all_counts.numel()] = all_counts.cumsum(0).to(torch.int32)
        add_wait_time(self.performance_info, agreement, wait_ns)
        self.outputs = (
            expand_x,
            dynamic_scales,
            assist,
            expert_token_nums,
            ep_recv_counts,
            tp_recv_counts,
            expand_scales,
        )

    @staticmethod
    def return_rows(assist: torch.Tensor, num_rows: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows ``[0, num_rows)`` of ``expand_x`` grouped by source rank (``assist_info_for_combine``'s triples),
        expert-major inside each source, and rows per source (none to masked sources)."""
        w = mask.numel()
        src = assist[: 3 * num_rows : 3].long()
        if num_rows and (int(src.min()) < 0 or int(src.max()) >= w):
            raise shape(
                "assist_info_for_combine", "holds a source rank outside [0, W); pass dispatch's output unchanged"
            )
        order = torch.argsort(src, stable=True)
        per_src = torch.bincount(src, minlength=w)
        if bool(mask.any()):
            keep = mask.to(src.device)[src[order]] == 0
            order, per_src = order[keep], per_src.masked_fill(mask.to(src.device).bool(), 0)
        return order, per_src.tolist()


def add_wait_time(performance_info: torch.Tensor | None, agreement: Agreement, wait_ns: int) -> None:
    """Add this call's wait (µs: the agreement step plus the payload wait) to ``performance_info[src]`` for every
    source rank that sent this rank data (one collective serves all sources, so they share its wait time)."""
    if performance_info is None:
        return
    sent = torch.tensor([bool(any(c)) for c in agreement.counts], device=performance_info.device)
    performance_info += sent.to(torch.int64) * (agreement.wait_us + wait_ns // 1000)
