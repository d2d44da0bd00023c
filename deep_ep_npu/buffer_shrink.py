"""Shrink mode of :class:`deep_ep_npu.Buffer` (DeepEP's ``enable_shrink``): the mask buffer and its bookkeeping.

A masked rank's experts are treated as absent: dispatch sends no token to it and ignores what it sends, combine
expects nothing from it, and a masked rank sends nothing (its own tokens combine to 0). Detecting failures (DeepEP
masks a rank when its receive times out) is not part of this module: the mask is set by the caller, must be the
same on every rank, and masked ranks still take part in the collectives. Implemented by the reference backend.
"""

from __future__ import annotations

import torch


class ShrinkMixin:
    """``low_latency_update/query/clean_mask_buffer`` (they need ``enable_shrink=True``)."""

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise RuntimeError("Shrink mode must be enabled: construct the Buffer with enable_shrink=True")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark ``rank_to_mask`` as absent (``mask=True``) or present again. Masked ranks' experts are treated as
        absent by dispatch and combine (no token goes to or comes from them; a masked rank sends nothing). Every
        rank must hold the same mask; masked ranks still take part in the collectives here."""
        self._check_shrink()
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask: {rank_to_mask} is outside [0, {self.group_size})")
        self._backend.mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask into ``mask_status`` `[R]` `torch.int32` (1 = masked)."""
        self._check_shrink()
        if mask_status.dtype != torch.int32 or tuple(mask_status.shape) != (self.group_size,):
            raise ValueError(
                f"mask_status: must be [{self.group_size}] torch.int32, got {mask_status.dtype} "
                f"{tuple(mask_status.shape)}"
            )
        mask_status.copy_(self._backend.mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._check_shrink()
        self._backend.mask.zero_()
