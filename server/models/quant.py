"""Int8 weights with per-output-channel scales and a per-token dynamic int8 activation quant (W8A8)."""

from __future__ import annotations

import torch


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``x`` `[rows, cols]` float -> (q `[rows, cols]` `torch.int8`,
    scale `[rows, 1]` `torch.float32`) with ``x ~= q * scale``, scale = amax / 127, round half to even."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x32 / scale).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear:
    """``y = x @ w.T`` with ``w`` stored as int8 per output channel; ``x`` is quantized per token on each call
    and the product runs as an int8 x int8 -> int32 matmul, rescaled in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        """``weight`` `[out_features, in_features]` float."""
        q, scale = quantize_per_row(weight)
        self.weight_t = q.t().contiguous()  # [in, out] int8
        self.scale = scale.t().contiguous()  # [1, out] fp32
        self.dtype = weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` `[num_tokens, in_features]` -> `[num_tokens, out_features]`, dtype of the original weight."""
        qx, sx = quantize_per_row(x)
        acc = torch._int_mm(qx, self.weight_t)
        return (acc.float() * sx * self.scale).to(self.dtype)
