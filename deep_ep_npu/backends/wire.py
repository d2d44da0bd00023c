"""The reference backend's dispatch row: one token, sent once per destination rank.

Row layout (``uint8``, ``row_bytes`` a multiple of 16)::

    [data: hidden x itemsize][scales: num_scales x fp32][src token: int32][local-expert bitmask: ceil(L/8) B][pad]

The bitmask says which of the destination's local experts want the token; the receiver expands the row into one
``recv_x`` row per set bit. fp8 and int8 data travel as bytes (gloo cannot carry float8).
"""

from __future__ import annotations

import torch

from ..fp8 import FP8_DTYPE, GROUP, pack_ue8m0, scale_for_fp8_
from ..ops.quant import per_token_int8

_BITS = torch.arange(8, dtype=torch.uint8)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class RowFormat:
    """How a token row of ``hidden`` channels travels for one (dtype, quant, num_local_experts) combination."""

    def __init__(
        self, hidden: int, dtype: torch.dtype, quant: str | None, num_local_experts: int, round_scale: bool = False
    ) -> None:
        self.hidden, self.quant, self.round_scale = hidden, quant, round_scale
        self.data_dtype = {None: dtype, "fp8_e4m3": FP8_DTYPE, "int8_per_token": torch.int8}[quant]
        self.num_scales = {None: 0, "fp8_e4m3": hidden // GROUP, "int8_per_token": 1}[quant]
        self.data_bytes = hidden * self.data_dtype.itemsize
        self.scale_off = _align(self.data_bytes, 4)
        self.token_off = self.scale_off + 4 * self.num_scales
        self.mask_off = self.token_off + 4
        self.mask_bytes = (num_local_experts + 7) // 8
        self.num_local_experts = num_local_experts
        self.row_bytes = _align(self.mask_off + self.mask_bytes, 16)

    def encode_into(
        self,
        out: torch.Tensor,
        x_rows: torch.Tensor,
        token: torch.Tensor,
        pair_row: torch.Tensor,
        pair_expert: torch.Tensor,
        work: torch.Tensor | None = None,
    ) -> None:
        """Fill ``out`` `[n, row_bytes]` uint8 from ``x_rows`` `[n, hidden]`, ``token`` `[n]` int64 (source row index)
        and the (row, local expert) pairs `[num_pairs]` int64 that set the bitmask. ``work`` (`[n, hidden]` fp32,
        optional) is scratch for the fp8 cast."""
        n = out.shape[0]
        data = out[:, : self.data_bytes].view(self.data_dtype)
        if self.quant is None:
            data.copy_(x_rows)
        else:
            if self.quant == "fp8_e4m3":
                work = torch.empty(x_rows.shape, dtype=torch.float32) if work is None else work
                scales = scale_for_fp8_(work, x_rows, self.round_scale)
                data.copy_(work)  # the cast to e4m3
            else:
                q, scale = per_token_int8(x_rows)
                scales = scale.unsqueeze(1)
                data.copy_(q)
            out[:, self.scale_off : self.token_off].view(torch.float32).copy_(scales)
        out[:, self.token_off : self.mask_off].view(torch.int32).copy_(token.view(n, 1))
        bits = torch.zeros((n, self.mask_bytes * 8), dtype=torch.uint8)
        bits[pair_row, pair_expert] = 1
        packed = (bits.view(n, self.mask_bytes, 8) << _BITS).sum(dim=2, dtype=torch.uint8)
        out[:, self.mask_off : self.mask_off + self.mask_bytes].copy_(packed)

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n]` int32 source token of each received row."""
        return rows[:, self.token_off : self.mask_off].view(torch.int32).view(-1)

    def expert_bits(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, num_local_experts]` bool: which local experts each received row is for."""
        packed = rows[:, self.mask_off : self.mask_off + self.mask_bytes]
        bits = (packed.unsqueeze(-1) >> _BITS) & 1
        return bits.view(rows.shape[0], self.mask_bytes * 8)[:, : self.num_local_experts].bool()

    @property
    def word_dtype(self) -> torch.dtype:
        """The widest integer type that tiles the data bytes (copies move words, not bytes)."""
        for dtype in (torch.int64, torch.int32, torch.int16):
            if self.data_bytes % dtype.itemsize == 0:
                return dtype
        return torch.uint8

    def scatter_data(self, rows: torch.Tensor, row: torch.Tensor, out: torch.Tensor, flat: torch.Tensor) -> None:
        """Copy the data of ``rows[row]`` into rows ``flat`` of ``out`` `[num_rows, hidden]` (``data_dtype``)."""
        word = self.word_dtype
        src = rows.view(word)[:, : self.data_bytes // word.itemsize]
        out.view(torch.uint8).view(word).index_copy_(0, flat, src[row])

    def gather_data(self, rows: torch.Tensor, row: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the data of ``rows[row]`` into ``out`` `[len(row), hidden]` (contiguous, ``data_dtype``) in one pass."""
        word = self.word_dtype
        src = rows.view(word)[:, : self.data_bytes // word.itemsize]
        torch.index_select(src, 0, row, out=out.view(torch.uint8).view(word))

    def scales(self, rows: torch.Tensor, row: torch.Tensor, use_ue8m0: bool) -> torch.Tensor:
        """Scales of ``rows[row]`` in DeepEP's shape: `[P, hidden // 128]` fp32 (int8: the per-token scale repeated
        per group), or `[P, hidden // 512]` int32 UE8M0 with ``use_ue8m0``."""
        s = rows[row, self.scale_off : self.token_off].view(torch.float32)
        if self.quant == "int8_per_token":
            return s.expand(-1, self.hidden // GROUP)
        return pack_ue8m0(s) if use_ue8m0 else s
