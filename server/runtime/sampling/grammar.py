"""Structured output on the worker that samples a request: its grammar's matcher, the token bitmask applied to its
logits row before sampling, and the matcher advanced by the token drawn.

Only constrained requests reach this module; the others sample exactly as before (the plain greedy ones stay in the
step's one batched argmax). Grammars arrive compiled and serialized (:class:`~server.engine_api.CompiledGrammar`);
a worker deserializes each once (kept by key) against its own tokenizer info, built from the same tokenizer files as
the driver's. Importing xgrammar and building that info takes a second or more, so a worker does it in a background
thread from its start: the first constrained request usually does not wait for it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from server.engine_api import CompiledGrammar, Tokenizer
from server.structured.vocab import no_control_mask, tokenizer_info

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger("server.runtime")
GRAMMARS_KEPT = 64  # deserialized grammars a worker keeps (least recently used dropped first)


class RequestGrammar:
    """One request's matcher. ``no_control`` (JSON grammars): the bitmask word mask of tokens without raw control
    characters (:func:`~server.structured.vocab.no_control_mask`)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int, no_control: torch.Tensor | None) -> None:
        import xgrammar as xgr

        self.matcher, self.vocab_size, self.no_control = matcher, vocab_size, no_control
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.active = True  # False once the grammar is done (terminated, or a token it refused was forced)

    @property
    def constrains(self) -> bool:
        """The next token is constrained (the grammar is active and not finished)."""
        return self.active and not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` `[rows, ceil(vocab / 32)]` `torch.int32`
        (xgrammar's layout)."""
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.no_control is not None:
            bitmask[index] &= self.no_control

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` `[vocab]` with `torch.float32`, a copy with every token the grammar does not allow next at
        -inf (the input itself when the grammar is no longer active)."""
        if not self.constrains:
            return logits
        import xgrammar as xgr

        self.fill(self._bitmask, 0)
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, self._bitmask[0].to(out.device), vocab_size=self.vocab_size)
        return out

    def accept(self, token: int) -> None:
        """Advance the matcher by the sampled ``token``."""
        if self.active and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            # only when every allowed logit was non-finite and a fallback token was taken: stop constraining
            logger.warning("the grammar refused sampled token %d; the rest of this output is unconstrained", token)
            self.active = False


def mask_rows(logits: torch.Tensor, grammars: list[RequestGrammar | None], vocab_size: int) -> None:
    """Mask, in place, each row of ``logits`` `[rows, vocab]` `torch.float32` whose entry of ``grammars`` constrains
    its next token: one bitmask for the rows, filled per matcher, applied in one call."""
    at = [i for i, g in enumerate(grammars) if g is not None and g.constrains]
    if not at:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    json_rows, no_control = [], None
    for i in at:
        g = grammars[i]
        assert g is not None
        g.matcher.fill_next_token_bitmask(bitmask, i)
        if g.no_control is not None:
            json_rows.append(i)
            no_control = g.no_control  # (one per worker)
    if no_control is not None:  # one op for every JSON row
        bitmask[json_rows] &= no_control
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=at)


class WorkerGrammars:
    """A worker's grammar engine: the tokenizer info (``load_tokenizer()`` read and turned into it in a background
    thread from construction on) and the deserialized grammars."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._info: xgrammar.TokenizerInfo | None = None
        self._no_control: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._compiled: collections.OrderedDict[str, xgrammar.CompiledGrammar] = collections.OrderedDict()
        self._ready = threading.Thread(target=self._prepare, args=(load_tokenizer,), name="grammar-setup", daemon=True)
        self._ready.start()

    def _prepare(self, load_tokenizer: Callable[[], Tokenizer]) -> None:
        # (not at a lower CPU priority: on a loaded machine a starved thread holding the GIL, or joined by the first
        # constrained request, stalled this worker's steps past its peers' collective timeout)
        try:
            self._info = tokenizer_info(load_tokenizer(), self.vocab_size)
            self._no_control = no_control_mask(self._info)
        except BaseException as e:  # noqa: BLE001 - raised by start(), on the worker's thread
            self._error = e

    def start(self, grammar: CompiledGrammar) -> RequestGrammar:
        """A fresh matcher at the start of ``grammar`` (waits for the set-up thread the first time, if needed)."""
        import xgrammar as xgr

        self._ready.join()
        if self._error is not None or self._info is None:
            raise RuntimeError(f"structured output is unavailable on this worker: {self._error}") from self._error
        compiled = self._compiled.get(grammar.key)
        if compiled is None:
            compiled = xgr.CompiledGrammar.deserialize_json(grammar.data, self._info)
            self._compiled[grammar.key] = compiled
            while len(self._compiled) > GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar.key)
        return RequestGrammar(xgr.GrammarMatcher(compiled), self.vocab_size, self._no_control if grammar.json else None)
