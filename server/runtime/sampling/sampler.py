"""Token sampling with vLLM's parameters.

Order, as vLLM: logit bias, then the penalties (repetition, frequency, presence), then temperature (skipped when
greedy: ``temperature`` under 1e-5), then min-p, top-k, top-p, then a draw from the request's generator. Greedy
takes the argmax of the biased and penalized logits, so it stays deterministic under every parameter.
Log-probabilities are the log-softmax of the logits after bias, penalties and temperature, before the min-p /
top-k / top-p truncation (what vLLM calls processed log-probabilities).
"""

from __future__ import annotations

import dataclasses

import torch

from server.engine_api import SamplingParams, TokenLogprob

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's _SAMPLING_EPS)


def make_generator(params: SamplingParams, fallback: torch.Generator) -> torch.Generator:
    """A request's own generator, on ``fallback``'s device (the worker's): seeded by ``params.seed``, else from
    ``fallback`` (the worker's generator)."""
    seed = (
        params.seed
        if params.seed is not None
        else int(torch.randint(0, 2**62, (1,), generator=fallback, device=fallback.device))
    )
    return torch.Generator(fallback.device).manual_seed(seed)


@dataclasses.dataclass
class TokenCounts:
    """What the penalties look at for one request.

    Arguments:
        prompt: `[vocab]` with `torch.bool`, the tokens of the prompt.
        output: `[vocab]` with `torch.int64`, how often each token was generated so far.
    """

    prompt: torch.Tensor
    output: torch.Tensor

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device) -> TokenCounts:
        return cls(
            torch.zeros(vocab_size, dtype=torch.bool, device=device),
            torch.zeros(vocab_size, dtype=torch.int64, device=device),
        )

    def add_prompt(self, token_ids: list[int]) -> None:
        self.prompt[torch.tensor(token_ids, dtype=torch.int64, device=self.prompt.device)] = True

    def add_output(self, token_id: int) -> None:
        self.output[token_id] += 1


def processed_logits(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None) -> torch.Tensor:
    """``logits`` `[vocab]` after logit bias, penalties and temperature; returns `[vocab]` with `torch.float32`.

    ``counts`` is required when ``params.needs_history``. Temperature is not applied when greedy.
    """
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=logits.device)
        logits = logits.index_add(0, ids, bias)
    if params.needs_history:
        assert counts is not None
        if params.repetition_penalty != 1.0:
            seen = counts.prompt | (counts.output > 0)
            scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        logits = logits - params.frequency_penalty * counts.output.float()
        logits = logits - params.presence_penalty * (counts.output > 0).float()
    if params.temperature >= GREEDY_BELOW:
        logits = logits / params.temperature
    # extreme values (a repetition penalty of 1e-300 is 0 in float32) must not make NaN probabilities
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, counts: TokenCounts | None = None
) -> int:
    """Sample one token id from ``logits`` `[vocab]` with `torch.float32` (``counts``: see
    :func:`processed_logits`)."""
    return choose(processed_logits(logits, params, counts), params, generator)


def choose(processed: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The token id for ``processed`` `[vocab]` with `torch.float32` (:func:`processed_logits`): the argmax when
    greedy, else a draw."""
    if params.temperature < GREEDY_BELOW:  # logits / a tiny temperature overflow to inf (then NaN probabilities)
        return int(torch.argmax(processed))
    return _draw(processed, params, generator)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """min-p, then top-k, then top-p (smallest set of tokens whose probability reaches ``top_p``; the most likely
    token is always kept), then a draw from ``generator``."""
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not bool(torch.isfinite(logits).any()):  # every token masked: fall back to the most likely one
        return int(torch.argmax(logits))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        drop[0] = False  # a top_p under float32's smallest value would otherwise drop every token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """``token_id``'s entry of ``logprobs`` `[vocab]` with `torch.float32` (a log-softmax) and its ``num_top``
    most likely tokens."""
    top = torch.topk(logprobs, min(num_top, logprobs.numel())) if num_top else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)
