"""A buffer's results' memory (:class:`ResultPool`)."""

from __future__ import annotations

import math

import torch


class ResultPool:
    """New tensors for calls' results (:meth:`take`): a CPU result of :attr:`min_bytes` or more reuses the memory of
    an earlier one whose every tensor and view is gone (a caching allocator, as a GPU's: a fresh page costs a page
    fault, more than the copy that fills it); at most :attr:`max_blocks` blocks are kept."""

    min_bytes, max_blocks = 1 << 20, 8

    def __init__(self) -> None:
        self.blocks: list[torch.UntypedStorage] = []

    def take(self, shape_: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeros: bool) -> torch.Tensor:
        nbytes = math.prod(shape_) * dtype.itemsize
        if device.type != "cpu" or nbytes < self.min_bytes:
            return (torch.zeros if zeros else torch.empty)(shape_, dtype=dtype, device=device)
        free = [s for s in self.blocks if torch._C._storage_Use_Count(s._cdata) == 1]  # (held by this list only)
        block = next((s for s in free if nbytes <= s.nbytes() <= 2 * nbytes), None)
        if block is None:
            if len(self.blocks) >= self.max_blocks and free:
                self.blocks.remove(free[0])
            block = torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
            if len(self.blocks) < self.max_blocks:
                self.blocks.append(block)
        out = torch.empty((0,), dtype=torch.uint8).set_(block)[:nbytes].view(dtype).view(shape_)
        return out.zero_() if zeros else out
