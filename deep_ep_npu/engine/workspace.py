"""Named, growable scratch tensors (a Buffer's communication buffer), on one device."""

from __future__ import annotations

import math

import torch


class Workspace:
    """``get(name, shape, dtype)`` returns a view of a reused byte buffer, grown when a call needs more."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device, self._tensors = torch.device(device), dict[str, torch.Tensor]()

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes, buf = math.prod(shape) * dtype.itemsize, self._tensors.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != self.device:
            buf = self._tensors[name] = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(dtype).view(shape)

    def clear(self) -> None:
        self._tensors.clear()
