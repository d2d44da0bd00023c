"""A request's output text, decoded incrementally (the stop rules, as each sampled token arrives: :mod:`.request`).

Re-decoding the whole output on every token costs O(length) per token, so a long request costs O(length^2). Here
each token decodes a short window instead: the tokens since the last emitted text plus those of the text emitted
before them (its context, for tokenizers whose decoding of a token depends on its neighbours, e.g. SentencePiece's
leading space). Text is emitted once the window no longer ends in an incomplete UTF-8 sequence (U+FFFD); the final
text (:meth:`IncrementalDetokenizer.finish`) is the decode of the window's tail as well.
"""

from __future__ import annotations

from server.engine_api import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The text of the token ids given to :meth:`add`, in order (``text``: what is final so far)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # the window starts here: the tokens of the text emitted last
        self._read_offset = 0  # the tokens from here have no text emitted yet

    def add(self, token_id: int) -> str:
        """Append ``token_id``; returns the text it completed (often empty while a character is incomplete)."""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """Emit whatever is pending (an incomplete character decodes as U+FFFD); returns it."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode, ids = self.tokenizer.decode, self.token_ids
        if self._read_offset == len(ids):
            return ""
        prefix = decode(ids[self._prefix_offset : self._read_offset])
        window = decode(ids[self._prefix_offset :])
        if not final and (len(window) <= len(prefix) or window.endswith(_INCOMPLETE)):
            return ""
        new = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.text += new
        return new
