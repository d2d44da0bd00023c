"""``Linear``: ``nn.Linear`` (same parameters, same checkpoint names) that multiplies a single row as a
matrix-vector product on the CPU, where ``torch.mv`` reads the weight about 1.4x faster than a one-row matmul
(bf16, measured with ``F.linear`` at 13 GB/s against ``torch.mv`` at 19 GB/s on 2 MiB weights). Decode at batch 1
is one row per projection, and bound by reading the weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: ``x`` `[rows, in]`, ``weight`` `[out, in]` -> `[rows, out]`, dtype of `x`."""
    if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu":
        out = torch.mv(weight, x[0])[None]
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
