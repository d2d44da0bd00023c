"""The reference backend's communication buffer: named growable scratch tensors, and an in-flight uneven
all-to-all of byte rows with a bounded wait."""

from __future__ import annotations

import time

import torch

from ..ep_group import EPGroup


class Workspace:
    """Named, growable scratch tensors (the backend's communication buffer)."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        buf = self._tensors.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty((max(nbytes, 1),), dtype=torch.uint8)
            self._tensors[name] = buf
        return buf[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def clear(self) -> None:
        self._tensors.clear()


class Exchange:
    """An in-flight uneven all-to-all of `[rows, width]` uint8 tensors, plus the time spent waiting for it."""

    def __init__(self, ep: EPGroup, recv: torch.Tensor, send: torch.Tensor, recv_rows: list[int], send_rows: list[int]):
        width = send.shape[1] if send.dim() == 2 else 0
        self.wait_ns, self._ep = 0, ep
        if len(send_rows) == 1:
            recv.copy_(send)
            self.work = None
        else:  # bounded wait; a missing peer raises EPRankFailure (deep_ep_npu.failure)
            recv_splits, send_splits = [r * width for r in recv_rows], [r * width for r in send_rows]
            self.work = ep.all_to_all(recv.view(-1), send.reshape(-1), recv_splits, send_splits, "payload exchange")

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter_ns()
            work, self.work = self.work, None
            self._ep.wait(work, "payload exchange")
            self.wait_ns = time.perf_counter_ns() - t0
