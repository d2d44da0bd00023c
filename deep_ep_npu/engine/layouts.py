"""Where received rows go: DeepEP's masked layout (:class:`Masked`; Ascend's flat one is :class:`~.flat.Flat`).

Both place the same received pairs (:class:`~.dispatch.Received`) by their (local expert, source rank), written
once. For combine, each layout also says where the rows of each source rank sit (``return_rows``), in the order
the source's plan expects them back: by source rank, then local expert, then token."""

from __future__ import annotations

import torch

from .. import kernels as cpu_kernels
from ..errors import shape
from ..group import Agreement
from ..handle import LowLatencyHandle
from .dispatch import Incoming
from .rows import RowFormat

LOOP_BYTES = 1 << 18
"""Received data above which the masked layout is filled by one gather per expert instead of one scatter."""


def exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


def sort_blocks(expert: torch.Tensor, src: torch.Tensor, num_local: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' order by (local expert, source) (stable) and their counts `[L, R]` int64."""
    key = expert * r + src
    return torch.argsort(key, stable=True), torch.bincount(key, minlength=num_local * r).view(num_local, r)


class Masked:
    """DeepEP's layout. Outputs, filled in place: ``recv_x`` `[L, R * N, hidden]` (``fmt.data_dtype``), ``scales``
    `[L, R * N, G]` (fp32, or int32 UE8M0) or None, ``src_info`` `[L, R * N]` int32, ``layout_range`` `[L, R]` int64
    ``(begin << 32) | count``, ``recv_count`` `[L]` int32; ``recv_stats`` `[L]` int32 and ``wait_stats`` `[R]`
    int64 (ns) accumulate. Inside expert i, this rank's own block comes first (placed while the remote rows
    travel), then the other sources by rank, tokens ascending."""

    names = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype", "use_fp8 format", "row bytes")

    def __init__(self, rank, recv_x, scales, src_info, layout_range, recv_count, use_ue8m0, recv_stats, wait_stats):
        self.rank, self.recv_x, self.scales, self.src_info = rank, recv_x, scales, src_info
        self.layout_range, self.recv_count, self.use_ue8m0 = layout_range, recv_count, use_ue8m0
        self.recv_stats, self.wait_stats = recv_stats, wait_stats
        self.counts_own: torch.Tensor | None = None

    def check(self, agreement: Agreement) -> None:
        agreement.check(self.rank, self.names)

    def _write(self, fmt: RowFormat, incoming: Incoming, base: torch.Tensor) -> torch.Tensor:
        """Place ``incoming``'s pairs in each expert's rows from ``base[expert]`` on; returns their counts `[L, R]`."""
        (num_local, rn), r = self.src_info.shape, self.layout_range.shape[1]
        if (counts := self._write_fused(fmt, incoming, base)) is not None:
            return counts
        got = incoming.parse(fmt)
        order, counts = sort_blocks(got.expert, got.src, num_local, r)
        row, local = got.row[order], got.expert[order]
        pos = torch.arange(order.numel(), device=row.device) - exclusive_cumsum(counts.sum(dim=1))[local] + base[local]
        flat = local * rn + pos
        rows = incoming.rows
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
        self._write_scales(fmt, rows, row, flat)
        self.src_info.view(-1)[flat] = fmt.tokens(rows)[row]
        return counts

    def _write_fused(self, fmt: RowFormat, incoming: Incoming, base: torch.Tensor) -> torch.Tensor | None:
        """:meth:`_write` in one pass per source (:func:`~.cpu_kernels.place`); None where the kernel does not apply."""
        num_local, rn = self.src_info.shape
        counts = torch.zeros((num_local, self.layout_range.shape[1]), dtype=torch.int64, device=base.device)
        pos, most = base.clone(), max((c for _, _, c in incoming.blocks), default=0)
        pairs = torch.empty((2, max(most * fmt.num_slots, 1)), dtype=torch.int64, device=base.device)
        for src, rows in incoming.sources():
            k = cpu_kernels.place(rows, fmt.data_bytes, fmt.token_off, fmt.slot_off, fmt.num_slots, self.recv_x,
                                  self.src_info, pos, counts, src, pairs)  # fmt: skip
            if k is None:  # (the same answer for every block: they are views of one tensor)
                return None
            if (
                self.scales is None
                or self.use_ue8m0
                or not cpu_kernels.place_scales(
                    rows, fmt.scale_off, pairs[0, :k], pairs[1, :k], self.scales, fmt.quant != "fp8_e4m3"
                )
            ):
                self._write_scales(fmt, rows, pairs[0, :k], pairs[1, :k])
        return counts

    def _write_scales(self, fmt: RowFormat, rows: torch.Tensor, row: torch.Tensor, flat: torch.Tensor) -> None:
        if self.scales is None:
            return
        rn = self.src_info.shape[1]
        s = fmt.scales(rows, row, self.use_ue8m0)
        self.scales[flat // rn, flat % rn] = s if fmt.quant == "fp8_e4m3" else s.expand(-1, self.scales.shape[2])

    def place_own(self, fmt: RowFormat, incoming: Incoming) -> None:
        zero = torch.zeros(self.src_info.shape[0], dtype=torch.int64, device=incoming.rows.device)
        self.counts_own = self._write(fmt, incoming, zero)

    def place_own_direct(self, fmt: RowFormat, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor) -> bool:
        """Place this rank's own pairs (``token`` / local ``expert`` `[n]` int64, sorted by (expert, token)) straight
        from ``x`` (:func:`~.cpu_kernels.place_pairs`: the rows :meth:`place_own` would place, with no packing);
        False (nothing done) unless rows carry ``x`` as is and the kernels apply: then pack and call place_own."""
        if fmt.quant is not None or self.scales is not None or x.dtype != self.recv_x.dtype:
            return False
        counts = torch.zeros(self.layout_range.shape, dtype=torch.int64, device=x.device)
        pos = torch.zeros(self.src_info.shape[0], dtype=torch.int64, device=x.device)
        if not cpu_kernels.place_pairs(x, token, expert, self.recv_x, self.src_info, pos, counts, self.rank):
            return False
        self.counts_own = counts
        return True

    def place_remote(self, fmt: RowFormat, incoming: Incoming, own: Incoming, agreement: Agreement,
                     wait_ns: int) -> None:  # fmt: skip
        assert self.counts_own is not None
        counts = self.counts_own + self._write(fmt, incoming, self.counts_own.sum(dim=1))
        r, me = counts.shape[1], self.rank
        if not cpu_kernels.layout_range(counts, me, self.layout_range, self.recv_count):
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
    def return_rows(handle: LowLatencyHandle, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows of the flattened `[L * R * N]` expert output to send back, by (source, expert, row), and rows per
        source (none to masked sources)."""
        (num_local, r), n = handle.layout_range.shape, handle.num_max_dispatch_tokens_per_rank
        outside = f"holds a block outside [0, R * N = {r * n}); pass dispatch's handle"
        if isinstance(fast := cpu_kernels.return_rows(handle.layout_range, n, mask), tuple):
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
