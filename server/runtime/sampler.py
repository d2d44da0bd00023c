"""Token sampling with vLLM's parameters: greedy (``temperature`` under 1e-5), temperature, top-k, top-p, seed."""

from __future__ import annotations

import torch

from ..engine_api import SamplingParams

_GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's _SAMPLING_EPS)


def make_generator(params: SamplingParams, fallback: torch.Generator) -> torch.Generator:
    """A request's own generator, on ``fallback``'s device (the worker's): seeded by ``params.seed``, else from
    ``fallback`` (the worker's generator)."""
    seed = (
        params.seed
        if params.seed is not None
        else int(torch.randint(0, 2**62, (1,), generator=fallback, device=fallback.device))
    )
    return torch.Generator(fallback.device).manual_seed(seed)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample one token id from ``logits`` `[vocab]` with `torch.float32`.

    Order as in vLLM: temperature, then top-k, then top-p (smallest set of tokens whose probability reaches
    ``top_p``; the most likely token is always kept), then a draw from ``generator``.
    """
    if params.temperature < _GREEDY_BELOW:  # logits / a tiny temperature overflow to inf (then NaN probabilities)
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        drop[0] = False  # a top_p under float32's smallest value would otherwise drop every token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
