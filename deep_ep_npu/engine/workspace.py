"""Named, growable scratch tensors (a Buffer's communication buffer), on one device."""

from __future__ import annotations

import math

import torch


class Workspace:
    """``get(name, shape, dtype)`` returns a view of a reused byte buffer, grown when a call needs more."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._tensors.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != self.device:
            buf = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=self.device)
            self._tensors[name] = buf
        return buf[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def clear(self) -> None:
        self._tensors.clear()
