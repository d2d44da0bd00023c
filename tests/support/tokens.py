"""Seeded routed tokens, as the Buffer and ops tests draw them."""

from __future__ import annotations

import torch


def routed_tokens(
    g: torch.Generator, num_tokens: int, hidden: int, topk: int, num_experts: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``g``, in this order: tokens `[num_tokens, hidden]` bf16 (normal, times ``scale``), each token's ``topk``
    distinct experts `[num_tokens, topk]` int64 (the head of a random permutation) and weights `[num_tokens, topk]`
    fp32 (uniform in [0, 1))."""
    x = (torch.randn((num_tokens, hidden), generator=g) * scale).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)])
    return x, idx, torch.rand((num_tokens, topk), generator=g)
