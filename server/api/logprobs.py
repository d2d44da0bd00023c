"""Log-probabilities in OpenAI's response shapes, from the engine's :class:`~server.engine_api.TokenLogprob` lists.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (``top_logprobs`` maps token text to
log-probability: the most likely tokens plus the sampled one; a prompt's first token has None, nothing precedes it).
Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
A token's text is the tokenizer's decoding of that token alone. JSON has no -inf: values are floored at -9999.0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from server.engine_api import Tokenizer, TokenLogprob

LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is sent as (vLLM does the same)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class LogprobFormatter:
    """Turns one tokenizer's token ids and log-probabilities into the response shapes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], offset: int) -> dict:
        """The completions shape for ``token_ids`` (``entries[i]`` belongs to ``token_ids[i]``); ``text_offset``
        counts from ``offset``, the characters of the choice's text before these tokens."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(entry.logprob))
            top = {self.text(t): _value(lp) for t, lp in entry.top}
            top.setdefault(text, _value(entry.logprob))
            out["top_logprobs"].append(top)
        return out

    def chat(self, entries: Sequence[TokenLogprob]) -> list[dict]:
        """The chat shape's ``content`` list."""
        return [
            {**self._chat_token(e.token_id, e.logprob), "top_logprobs": [self._chat_token(t, lp) for t, lp in e.top]}
            for e in entries
        ]

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    def prompt(self, entries: Sequence[TokenLogprob | None]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` shape: per prompt token None (the first) or ``{token_id: {"logprob",
        "decoded_token"}}`` for the prompt's token and the most likely ones."""
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            pairs = [(e.token_id, e.logprob), *e.top]
            out.append({str(t): {"logprob": _value(lp), "decoded_token": self.text(t)} for t, lp in pairs})
        return out
