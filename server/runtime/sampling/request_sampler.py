"""One request's sampling state on its worker: params, generator, the token counts the penalties need and the
prompt log-probabilities collected chunk by chunk.

A request's tokens reach its worker as plan entries: prompt chunks until the first sample, then one token per step,
each the token sampled the step before. So the prompt is everything fed before the first sample, and the output is
what :meth:`RequestSampler.sample` drew.
"""

from __future__ import annotations

import torch

from server.engine_api import SamplingParams, TokenLogprob
from server.runtime.sampling.grammar import RequestGrammar
from server.runtime.sampling.sampler import (
    GREEDY_BELOW,
    TokenCounts,
    choose,
    make_generator,
    processed_logits,
    token_logprob,
)


class RequestSampler:
    """The sampling state of the request in one KV-cache slot."""

    def __init__(
        self, params: SamplingParams, fallback: torch.Generator, vocab_size: int, grammar: RequestGrammar | None = None
    ) -> None:
        """``fallback``: the worker's generator (seeds requests without ``seed``; its device is the worker's);
        ``grammar``: the matcher of a constrained request (its mask goes on the logits before anything else)."""
        self.params = params
        self.grammar = grammar
        self.generator = make_generator(params, fallback)
        device = fallback.device
        self.counts = TokenCounts.empty(vocab_size, device) if params.needs_history else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else []
        self._previous_row: torch.Tensor | None = None  # log-softmax of the last prompt row so far
        self.sampled = False

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the raw logits (under its grammar's mask, when it has one) and nothing else
        is asked for (no bias, no penalty, no log-probabilities): the worker takes it in one batched argmax with the
        step's other such requests."""
        p = self.params
        return (
            p.temperature < GREEDY_BELOW
            and not p.logit_bias
            and self.counts is None
            and p.logprobs is None
            and not self.wants_all_logits
            and self.prompt_logprobs is None
        )

    def mark_sampled(self, token: int | None = None) -> None:
        """Its ``token`` was taken by the batched argmax (:attr:`plain_greedy`; its grammar's mask applied, if it
        has one; None: no token, the row was not finite): what follows is output."""
        self.sampled = True
        if self.grammar is not None and token is not None:
            self.grammar.accept(token)

    @property
    def wants_all_logits(self) -> bool:
        """The next prompt chunk needs the logits of each of its tokens (prompt log-probabilities)."""
        return self.prompt_logprobs is not None and not self.sampled

    def resume(self, prompt_ids: list[int], first_token: int) -> None:
        """Start from a prompt computed elsewhere (a prefill instance) and its first sampled token: what follows
        is output (penalties count the prompt and that token, a grammar advances past it; prompt log-probabilities
        came from there)."""
        if self.counts is not None:
            self.counts.add_prompt(prompt_ids)
            self.counts.add_output(first_token)
        if self.grammar is not None:  # the prefill instance sampled it under the same grammar
            self.grammar.accept(first_token)
        self.prompt_logprobs, self._previous_row, self.sampled = None, None, True

    def feed(self, token_ids: list[int], logits: torch.Tensor | None) -> None:
        """Record a chunk of input tokens. Before the first sample they are prompt tokens; ``logits``
        `[len(token_ids), vocab]` with `torch.float32` is their rows' logits when :attr:`wants_all_logits`."""
        if self.sampled:  # a decode input: the token sampled last step, already counted
            return
        if self.counts is not None:
            self.counts.add_prompt(token_ids)
        if self.prompt_logprobs is not None:
            assert logits is not None and logits.shape[0] == len(token_ids)
            rows = torch.log_softmax(logits.float(), dim=-1)
            num_top = self.params.prompt_logprobs or 0
            for i, token in enumerate(token_ids):
                previous = self._previous_row if i == 0 else rows[i - 1]
                self.prompt_logprobs.append(None if previous is None else token_logprob(previous, token, num_top))
            self._previous_row = rows[-1]

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None, list[TokenLogprob | None] | None]:
        """Draw the next token from ``logits`` `[vocab]` with `torch.float32`; returns it, its log-probabilities
        (when asked for) and, on the first sample only, the prompt's log-probabilities (when asked for)."""
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        processed = processed_logits(logits, self.params, self.counts)
        token = choose(processed, self.params, self.generator)
        if self.grammar is not None:
            self.grammar.accept(token)
        num_top = self.params.logprobs
        logprob = None if num_top is None else token_logprob(torch.log_softmax(processed, dim=-1), token, num_top)
        if self.counts is not None:
            self.counts.add_output(token)
        prompt = None
        if not self.sampled:
            prompt, self.prompt_logprobs, self._previous_row = self.prompt_logprobs, None, None
            self.sampled = True
        return token, logprob, prompt
