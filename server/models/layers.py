"""Small building blocks shared by every architecture: RMSNorm, rotary embeddings, the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 and cast back before the weight (as HF does)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding over the last dim (``rotate_half`` layout, or interleaved pairs for DeepSeek)."""

    def __init__(self, dim: int, theta: float, interleave: bool = False) -> None:
        super().__init__()
        self.interleave = interleave
        # A non-persistent buffer (not in the state dict, which the loader fills): computed here, on the build device.
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                             persistent=False)  # fmt: skip

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[T]`` -> cos, sin ``[T, dim]`` in ``dtype`` (angles duplicated, as HF)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``x`` ``[T, heads, dim]``, cos/sin ``[T, dim]`` -> rotated ``x``, same shape and dtype."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleave:
            half = cos.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with HF's parameter names (also the DeepSeek shared experts)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
