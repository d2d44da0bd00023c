"""Row codecs: how one token row travels on the wire as a fixed number of bytes.

A codec turns `[n, hidden]` rows into `[n, row_bytes]` ``uint8`` (data, then its scales, padded to 16 bytes so that
every field is aligned when the receive buffer is viewed as rows) and back. ``float8`` and other dtypes that gloo
cannot carry travel as these bytes.
"""

from __future__ import annotations

import abc

import torch

from .quant import dequant_per_group_int8, per_group_int8, per_token_int8

ROW_ALIGN = 16


def _align(x: int, a: int = ROW_ALIGN) -> int:
    return (x + a - 1) // a * a


class RowCodec(abc.ABC):
    """Packs `[n, hidden]` rows into `[n, row_bytes]` bytes (:meth:`encode`) and unpacks them (:meth:`decode`)."""

    hidden: int
    data_dtype: torch.dtype
    num_scales: int = 0

    @property
    def data_bytes(self) -> int:
        return self.hidden * self.data_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return _align(self.data_bytes + 4 * self.num_scales)

    @abc.abstractmethod
    def encode(self, rows: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, hidden]` rows (and optional `[n, hidden]` fp32 smooth scales) to `[n, row_bytes]` ``uint8``."""

    def decode_into(self, packed: torch.Tensor, data_out: torch.Tensor, scales_out: torch.Tensor | None) -> None:
        """Write `[n, row_bytes]` ``uint8`` rows into `data_out` `[n, hidden]` and `scales_out` `[n, num_scales]`."""
        data_out.copy_(packed[:, : self.data_bytes].view(self.data_dtype))
        if scales_out is not None and self.num_scales:
            scales_out.copy_(packed[:, self.data_bytes : self.data_bytes + 4 * self.num_scales].view(torch.float32))

    def decode_float(self, packed: torch.Tensor) -> torch.Tensor:
        """`[n, row_bytes]` ``uint8`` rows to `[n, hidden]` `torch.float32` values (what combine weights)."""
        return packed[:, : self.data_bytes].view(self.data_dtype).float()

    def _pack(self, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((data.shape[0], self.row_bytes), dtype=torch.uint8, device=data.device)
        out[:, : self.data_bytes].view(self.data_dtype).copy_(data)
        if self.num_scales:
            out[:, self.data_bytes : self.data_bytes + 4 * self.num_scales].view(torch.float32).copy_(scales)
        if self.row_bytes > self.data_bytes + 4 * self.num_scales:
            out[:, self.data_bytes + 4 * self.num_scales :].zero_()
        return out


class PlainCodec(RowCodec):
    """Rows travel as they are (``data_dtype`` = the activation dtype), no scales."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        self.hidden, self.data_dtype = hidden, dtype

    def encode(self, rows: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> torch.Tensor:
        return self._pack(rows, None)


class Int8TokenCodec(RowCodec):
    """Ascend ``quant_mode=2``: int8 data plus one fp32 scale per row (:func:`per_token_int8`)."""

    num_scales = 1

    def __init__(self, hidden: int) -> None:
        self.hidden, self.data_dtype = hidden, torch.int8

    def encode(self, rows: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = per_token_int8(rows, smooth_scales)
        return self._pack(q, scale.unsqueeze(-1))


class Int8GroupCodec(RowCodec):
    """Combine ``comm_quant_mode=2``: int8 data plus one scale per ``group`` elements in the activation dtype
    (:func:`per_group_int8`); decoded as ``to_dtype(q * scale)``, so the values keep the output dtype's precision."""

    def __init__(self, hidden: int, dtype: torch.dtype, group: int = 8) -> None:
        self.hidden, self.data_dtype, self.scale_dtype, self.group = hidden, torch.int8, dtype, group

    @property
    def scale_bytes(self) -> int:
        return self.hidden // self.group * self.scale_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return _align(self.hidden + self.scale_bytes)

    def encode(self, rows: torch.Tensor, smooth_scales: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = per_group_int8(rows, self.group)
        out = torch.zeros((rows.shape[0], self.row_bytes), dtype=torch.uint8, device=rows.device)
        out[:, : self.hidden].view(torch.int8).copy_(q)
        out[:, self.hidden : self.hidden + self.scale_bytes].view(self.scale_dtype).copy_(scale)
        return out

    def decode_float(self, packed: torch.Tensor) -> torch.Tensor:
        q = packed[:, : self.hidden].view(torch.int8)
        scale = packed[:, self.hidden : self.hidden + self.scale_bytes].view(self.scale_dtype)
        return dequant_per_group_int8(q, scale, self.group).to(self.scale_dtype).float()
