"""How one row travels: a fixed size per row, so a receive buffer is indexed by row. A dispatch row (uint8,
``row_bytes`` a multiple of 16)::

    [data: hidden x itemsize][scales][src token: int32][local expert per slot: num_slots x int32][weights fp32]

Scales: none, fp32 per 128 channels (DeepEP fp8) or a :class:`~deep_ep_npu.quant.Quant`'s. Slot ``j`` holds the
receiver's local expert of pair (token, j), or -1; the receiver expands a row into one row per used slot. float8 /
int8 data and e8m0 scales travel as bytes (gloo cannot carry float8)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import kernels
from ..quant import INT8_PER_TOKEN, Quant, pack_ue8m0
from .plan import Plan

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.int8: 4}  # dtypes in fingerprints
Parts = list[tuple[int, torch.Tensor]]  # received rows: (source rank, `[n, row_bytes]` uint8) in rank order


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class RowFormat:
    """A dispatch row of ``hidden`` channels for one (dtype, quant, slots, weights) combination (``quant``: None or
    a :class:`Quant`, DeepEP's fp8 included)."""

    def __init__(
        self,
        hidden: int,
        dtype: torch.dtype,
        quant: Quant | None,
        num_slots: int,
        weights: bool,
    ) -> None:
        self.hidden, self.quant, self.num_slots = hidden, quant, num_slots
        self.data_dtype = dtype if quant is None else quant.dtype
        scale_bytes = 0 if quant is None else quant.scale_bytes(hidden)
        self.data_bytes = hidden * self.data_dtype.itemsize
        self.scale_off = align(self.data_bytes, 4)
        self.scale_end = self.scale_off + scale_bytes
        self.token_off = align(self.scale_end, 4)
        self.slot_off = self.token_off + 4
        self.weight_off = self.slot_off + 4 * num_slots
        self.end = self.weight_off + (4 * num_slots if weights else 0)
        self.row_bytes = align(self.end, 16)
        words = [w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if self.data_bytes % w.itemsize == 0]
        self.word = words[0]  # copies move the widest integer words that tile the data, not bytes

    def write_fields(
        self, out: torch.Tensor, token: torch.Tensor, slot_expert: torch.Tensor, weights: torch.Tensor | None
    ) -> None:
        out[:, self.token_off : self.slot_off].view(torch.int32).copy_(token.view(-1, 1))
        out[:, self.slot_off : self.weight_off].view(torch.int32).copy_(slot_expert)
        if weights is not None:
            out[:, self.weight_off : self.end].view(torch.float32).copy_(weights)

    def encode_gathered(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        token: torch.Tensor,
        slot_expert: torch.Tensor,
        weights: torch.Tensor | None,
        smooth: torch.Tensor | None = None,
        remote: bool = False,
    ) -> None:
        """Fill ``out`` `[n, row_bytes]` uint8 with rows ``x[token]`` (``x`` `[T, hidden]`, ``token`` `[n]` int64),
        ``slot_expert`` `[n, num_slots]` int32, ``weights`` `[n, num_slots]` fp32 (or None) and int8 ``smooth``
        `[n, hidden]`; ``remote``: another process reads ``out`` (a peer's window)."""
        if (q := self.quant) is None:
            return self.copy_rows(out, x, token, slot_expert, weights, remote)
        int8 = q == INT8_PER_TOKEN and smooth is None
        fp8 = q.deepep and not q.round_scale and weights is None and smooth is None
        if int8 and kernels.pack_int8(x, token, slot_expert, weights, out, self):
            return None
        if fp8 and kernels.pack_fp8(x, token, slot_expert, out, self):
            return None
        data, scales = q(torch.index_select(x, 0, token), smooth)
        out[:, : self.data_bytes].view(self.data_dtype).copy_(data)
        if scales is not None:
            raw = scales.contiguous().view(torch.uint8).reshape(len(out), self.scale_end - self.scale_off)
            out[:, self.scale_off : self.scale_end].copy_(raw)
        return self.write_fields(out, token, slot_expert, weights)

    def copy_rows(
        self,
        out: torch.Tensor,
        src: torch.Tensor,
        token: torch.Tensor,
        slot_expert: torch.Tensor,
        weights: torch.Tensor | None,
        remote: bool = False,
    ) -> None:
        """Rows ``src[token]`` (unquantized tokens `[T, hidden]`, or :meth:`encode_tokens`' rows) into ``out``, then
        the token, ``slot_expert`` and ``weights`` fields: one gather, not a gather and a copy."""
        if weights is None and kernels.pack(src, token, slot_expert, out, self.token_off, self.slot_off, remote):
            return
        torch.index_select(src, 0, token, out=out[:, : src.shape[1] * src.element_size()].view(src.dtype))
        self.write_fields(out, token, slot_expert, weights)

    def encode_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every token of ``x`` `[T, hidden]` encoded once, `[T, row_bytes]` uint8 (data and scales; the token and
        slot fields are placeholders): :meth:`copy_rows` makes the rows from it (the same bytes as encoding them)."""
        t = x.shape[0]
        out = torch.empty((t, self.row_bytes), dtype=torch.uint8, device=x.device)
        table = torch.full((t, self.num_slots), -1, dtype=torch.int32, device=x.device)
        self.encode_gathered(out, x, torch.arange(t, device=x.device), table, None)
        return out

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.token_off : self.slot_off].view(torch.int32).view(-1)

    def slot_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, num_slots]` int32: the local expert of each slot (-1: not for this rank)."""
        return rows[:, self.slot_off : self.weight_off].view(torch.int32)

    def weights(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.weight_off : self.end].view(torch.float32)

    def _data(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(self.word)[:, : self.data_bytes // self.word.itemsize]

    def scatter_data(self, rows: torch.Tensor, row: torch.Tensor, out: torch.Tensor, pos: torch.Tensor) -> None:
        """Copy the data of ``rows[row]`` into rows ``pos`` of ``out`` `[num_rows, hidden]` (``data_dtype``)."""
        out.view(torch.uint8).view(self.word).index_copy_(0, pos, torch.index_select(self._data(rows), 0, row))

    def gather_data(self, rows: torch.Tensor, row: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the data of ``rows[row]`` into ``out`` `[len(row), hidden]` (contiguous, ``data_dtype``)."""
        torch.index_select(self._data(rows), 0, row, out=out.view(torch.uint8).view(self.word))

    def scales(self, rows: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """Scales of ``rows[row]``: `[P, hidden // 128]` fp32 for fp8 (`[P, hidden // 512]` int32 UE8M0 with
        ``ue8m0``), `[P, 1]` fp32 for int8."""
        s = self.scale_bytes(rows, row).view(torch.float32)
        return pack_ue8m0(s) if self.quant is not None and self.quant.ue8m0 else s

    def scale_bytes(self, rows: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """The raw scale bytes of ``rows[row]``: `[P, scale bytes]` uint8 (any scale dtype)."""
        return rows[row, self.scale_off : self.scale_end]


@functools.lru_cache(maxsize=256)
def row_format(hidden: int, dtype: torch.dtype, quant: Quant | None, num_slots: int, weights: bool) -> RowFormat:
    """The :class:`RowFormat` of these arguments, made once per combination (a steady-state call makes none)."""
    return RowFormat(hidden, dtype, quant, num_slots, weights)


def parse(fmt: RowFormat, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs that dispatch ``rows`` `[n, row_bytes]` uint8 carry: (row, slot, local expert), each `[P]` int64, in
    row order."""
    table = fmt.slot_experts(rows)
    row, slot = (table >= 0).nonzero(as_tuple=True)
    return row, slot, table[row, slot].long()


def slot_table(plan: Plan, num_slots: int) -> torch.Tensor:
    """`[rows, num_slots]` int32: per row of ``plan`` and slot, the local expert (-1: unused slot)."""
    shape, table = (int(plan.row_token.numel()), num_slots), plan.slot_expert
    if table is None or table.shape != shape:
        table = torch.full(shape, -1, dtype=torch.int32, device=plan.token.device)
        table[plan.row_of_pair, plan.slot] = plan.expert.to(torch.int32)
    return table


def encoder(
    fmt: RowFormat, x: torch.Tensor, plan: Plan, weights: torch.Tensor | None, smooth: torch.Tensor | None
) -> Callable[[bool, int, torch.Tensor], None]:
    """``encode(remote, d, out)``: the plan's rows for destination ``d`` of ``x`` `[T, hidden]` into ``out`` `[n,
    row_bytes]` uint8 (``weights`` `[P]` fp32 per pair, ``smooth`` `[num_rows, hidden]` fp32 per row, or None;
    ``remote``: a peer reads ``out``). Quantized rows without smoothing, when some token goes to more than one rank:
    each token is quantized once per call (not once per rank it goes to) and its bytes are copied into its rows."""
    shape, dev, w = (int(plan.row_token.numel()), fmt.num_slots), plan.token.device, None
    slot_expert = slot_table(plan, fmt.num_slots)
    if weights is not None:  # per row and slot: the pair's weight
        w = torch.zeros(shape, dtype=torch.float32, device=dev)
        w[plan.row_of_pair, plan.slot] = weights
    once = fmt.quant is not None and smooth is None and plan.row_token.numel() > x.shape[0]
    encoded: list[torch.Tensor] = []
    slices = plan.row_slices()

    def encode(remote: bool, d: int, out: torch.Tensor) -> None:
        rows = slices[d]
        ww = None if w is None else w[rows]
        if once:
            if not encoded:
                encoded.append(fmt.encode_tokens(x))
            fmt.copy_rows(out, encoded[0], plan.row_token[rows], slot_expert[rows], ww, remote)
        else:
            sm = None if smooth is None else smooth[rows]
            fmt.encode_gathered(out, x, plan.row_token[rows], slot_expert[rows], ww, sm, remote=remote)

    return encode
