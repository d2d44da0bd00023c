"""Shrink mode of :class:`deep_ep_npu.Buffer` (DeepEP's ``enable_shrink``): the mask buffer and its bookkeeping.

A masked rank's experts are treated as absent: dispatch sends no token to it and ignores what it sends, combine
expects nothing from it, and a masked rank sends nothing (its own tokens combine to 0).

Two ways a rank gets masked:

- by the caller (``low_latency_update_mask_buffer``): the mask must be the same on every rank, and masked ranks
  still take part in the collectives;
- by a failure (DeepEP masks a rank whose receive times out): when a rank exits or stops calling, the survivors
  agree on the failed set (:mod:`deep_ep_npu.failure`), continue on a group of themselves and mask the failed
  ranks (:mod:`deep_ep_npu.ep_group`); the interrupted call is re-run there. A failed rank cannot be unmasked
  (``low_latency_clean_mask_buffer`` keeps it masked); build a new Buffer to bring it back.

Implemented by the reference backend.
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
        if not mask and rank_to_mask in self._backend.ep.failed:
            raise ValueError(f"rank_to_mask: rank {rank_to_mask} failed and left the group; it cannot be unmasked")
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
        """Unmask every rank, except ranks that failed (they left the group and stay masked)."""
        self._check_shrink()
        self._backend.mask.zero_()
        self._backend.mask[self._backend.ep.failed] = 1
