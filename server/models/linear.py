"""``Linear``: ``nn.Linear`` (same parameters, same checkpoint names) that multiplies decode's few rows the way that
reads the weight fastest on the CPU. Decode is bound by reading the weights: bf16 runs on
:func:`deep_ep_npu.kernels.expert_mm.expert_mm` (one sequential stream per thread, ~24 GB/s here against ~4 GB/s for
torch's bf16 ``addmv``); a single row of another dtype as ``torch.mv``, which reads the weight ~1.4x faster than a
one-row matmul (measured with ``F.linear`` at 13 GB/s against ``torch.mv`` at 19 GB/s on 2 MiB fp32 weights).
:func:`fuse_linears` lays several projections of one input out as one (q / k / v, gate / up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from deep_ep_npu.kernels.expert_mm import ROWS_PER_EXPERT, expert_mm

_ROWS = [torch.tensor([n], dtype=torch.int32) for n in range(ROWS_PER_EXPERT + 1)]
"""``expert_mm``'s offsets for one expert of ``n`` rows, made once (decode calls ``linear`` ~17 times a step)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: ``x`` `[rows, in]`, ``weight`` `[out, in]` -> `[rows, out]`, dtype of `x`."""
    if x.dim() == 2 and x.shape[0] <= ROWS_PER_EXPERT and x.device.type == "cpu":
        if (out := expert_mm(x, weight[None], _ROWS[x.shape[0]])) is not None:
            return out if bias is None else out + bias
        if x.shape[0] == 1:
            out = torch.mv(weight, x[0])[None]
            return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def fuse_linears(*layers: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight `[sum of out, in]` (and bias, if the layers have biases) holding ``layers``' weights one after
    another, for one matmul in place of several; each layer's parameters become views into it, so the state dict keeps
    its names and sizes, nothing is held twice, and an in-place load into a layer's weight reaches the fused one."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])  # type: ignore[misc]
    begin = 0
    for layer in layers:
        end = begin + layer.weight.shape[0]
        layer.weight = nn.Parameter(weight[begin:end], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[begin:end], requires_grad=False)
        begin = end
    return weight, bias


_M = TypeVar("_M", bound="FusedLinears")


class FusedLinears(nn.Module):
    """A module that runs some of its ``Linear`` children as one projection (:func:`fuse_linears`). ``nn.Module``'s
    conversions (``to()``, ``float()``, ``bfloat16()``, ...) replace each parameter's data on its own, which leaves
    the fused weight behind (old dtype or device) and the parameters no longer views of it: they re-fuse afterwards."""

    def fuse_weights(self) -> None:
        raise NotImplementedError

    def is_fused(self) -> bool:
        raise NotImplementedError

    def _apply(self: _M, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _M:
        super()._apply(fn, recurse)
        if self.is_fused():
            self.fuse_weights()
        return self
