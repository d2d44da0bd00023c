"""Structured output on the worker that samples a request: its grammar's matcher, the token bitmask applied to its
logits row before sampling, and the matcher advanced by the token drawn.

Only constrained requests reach this module; the others sample exactly as before (the plain greedy ones stay in the
step's one batched argmax). Grammars arrive compiled and serialized (:class:`~server.engine_api.CompiledGrammar`);
a worker deserializes each once (kept by key) against its own tokenizer info, built from the same tokenizer files as
the driver's on the first constrained request.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch

from ..engine_api import CompiledGrammar, Tokenizer
from ..structured.vocab import no_control_mask, tokenizer_info

logger = logging.getLogger("server.runtime")
GRAMMARS_KEPT = 64  # deserialized grammars a worker keeps (least recently used dropped first)


class RequestGrammar:
    """One request's matcher. ``no_control`` (JSON grammars): the bitmask word mask of tokens without raw control
    characters (:func:`~server.structured.vocab.no_control_mask`)."""

    def __init__(self, matcher: Any, vocab_size: int, no_control: torch.Tensor | None) -> None:
        import xgrammar as xgr

        self.matcher, self.vocab_size, self.no_control = matcher, vocab_size, no_control
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.active = True  # False once the grammar is done (terminated, or a token it refused was forced)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` `[vocab]` with `torch.float32`, a copy with every token the grammar does not allow next at
        -inf (the input itself when the grammar is no longer active)."""
        if not self.active or self.matcher.is_terminated():
            return logits
        import xgrammar as xgr

        self.matcher.fill_next_token_bitmask(self._bitmask)
        if self.no_control is not None:
            self._bitmask[0] &= self.no_control
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, self._bitmask[0].to(out.device), vocab_size=self.vocab_size)
        return out

    def accept(self, token: int) -> None:
        """Advance the matcher by the sampled ``token``."""
        if self.active and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            # only when every allowed logit was non-finite and a fallback token was taken: stop constraining
            logger.warning("the grammar refused sampled token %d; the rest of this output is unconstrained", token)
            self.active = False


class WorkerGrammars:
    """A worker's grammar engine: the tokenizer info (built on first use) and the deserialized grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._info: Any = None
        self._no_control: torch.Tensor | None = None
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def start(self, grammar: CompiledGrammar) -> RequestGrammar:
        """A fresh matcher at the start of ``grammar``."""
        import xgrammar as xgr

        if self._info is None:
            self._info = tokenizer_info(self.tokenizer, self.vocab_size)
            self._no_control = no_control_mask(self._info)
        compiled = self._compiled.get(grammar.key)
        if compiled is None:
            compiled = xgr.CompiledGrammar.deserialize_json(grammar.data, self._info)
            self._compiled[grammar.key] = compiled
            while len(self._compiled) > GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar.key)
        return RequestGrammar(xgr.GrammarMatcher(compiled), self.vocab_size, self._no_control if grammar.json else None)
