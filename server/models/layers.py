"""Small building blocks shared by every architecture: RMSNorm (with the residual add before it, fused) and the SwiGLU
MLP (rotary embeddings: ``rope.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deep_ep_npu.kernels.rms_norm import add_rms_norm, rms_norm

from .linear import FusedLinears, Linear, fuse_linears, linear


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 and cast back before the weight (as HF does); with
    ``weight_fp32`` the weight multiplies in fp32 and the product is cast (gpt-oss)."""

    def __init__(self, hidden: int, eps: float, weight_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps, self.weight_fp32 = eps, weight_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := rms_norm(x, self.weight, self.eps, round_first=not self.weight_fp32)) is not None:
            return y  # (bf16 on the CPU: the same ops in one kernel call)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(dtype) if self.weight_fp32 else self.weight * x32.to(dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: ``x + delta`` (``x`` itself without ``delta``) and its norm, both `[...,
        hidden]` in ``x``'s dtype; one kernel call for bf16 on the CPU, which adds into ``x`` in place."""
        if delta is None:
            return x, self(x)
        if (y := add_rms_norm(x, delta, self.weight, self.eps, round_first=not self.weight_fp32)) is not None:
            return x, y
        x = x + delta
        return x, self(x)


class DenseMLP(FusedLinears):
    """``down(silu(gate(x)) * up(x))`` with HF's parameter names (also the DeepSeek shared experts); gate and up run
    as one projection (:meth:`fuse_weights`; again after a dtype or device change)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self._gate_up: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        """Lay ``gate_proj`` / ``up_proj`` out as one projection (:func:`~server.models.linear.fuse_linears`); the
        loader calls it once, after filling the weights (a forward step before that does it itself)."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)[0]

    def is_fused(self) -> bool:
        return self._gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            self.fuse_weights()
        assert self._gate_up is not None
        gate, up = linear(x, self._gate_up).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
