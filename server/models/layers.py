"""Small building blocks shared by every architecture: RMSNorm and the SwiGLU MLP (rotary embeddings: ``rope.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deep_ep_npu.kernels.rms_norm import rms_norm

from .linear import Linear


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


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with HF's parameter names (also the DeepSeek shared experts)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
