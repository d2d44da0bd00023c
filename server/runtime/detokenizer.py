"""A request's output text, decoded incrementally, and the stop rules applied as each sampled token arrives.

Re-decoding the whole output on every token costs O(length) per token, so a long request costs O(length^2). Here
each token decodes a short window instead: the tokens since the last emitted text plus those of the text emitted
before them (its context, for tokenizers whose decoding of a token depends on its neighbours, e.g. SentencePiece's
leading space). Text is emitted once the window no longer ends in an incomplete UTF-8 sequence (U+FFFD); the final
text (:meth:`IncrementalDetokenizer.finish`) is the decode of the window's tail as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engine_api import NONFINITE_ERROR, NONFINITE_TOKEN, RequestDelta, Tokenizer, TokenLogprob

if TYPE_CHECKING:
    from .scheduler import Request

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


def apply_token(req: Request, token: int, max_model_len: int, logprob: TokenLogprob | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestDelta:  # fmt: skip
    """Append a sampled token, extend the text and decide whether the request finished (vLLM semantics: EOS and
    stop token ids are kept in ``token_ids`` but not in the text; a stop string and what follows are cut off).
    ``logprob`` and ``prompt_logprobs`` (the worker's, when asked for) go into the delta; ``NONFINITE_TOKEN`` (the
    worker found NaN / Inf in the request's logits) ends it with an error."""
    if token == NONFINITE_TOKEN:
        req.finish_reason = "error"
        return RequestDelta(req.request_id, [], req.detokenizer.text, "error", NONFINITE_ERROR, req.prompt_len,
                            req.num_output)  # fmt: skip
    req.token_ids.append(token)
    p, detok = req.params, req.detokenizer
    reason = None
    before = len(detok.text)
    if token in (p.stop_token_ids or []) or (not p.ignore_eos and token in detok.tokenizer.eos_token_ids):
        reason = "stop"
    else:
        detok.add(token)
    n_out = req.num_output
    if reason is None and (n_out >= p.max_tokens or len(req.token_ids) >= max_model_len):
        reason = "length"
    if reason is not None:
        detok.finish()
    text = detok.text
    longest = max((len(s) for s in p.stop_strings), default=0)
    hits = [i for i in (text.find(s, max(0, before - longest + 1)) for s in p.stop_strings if s) if i >= 0]
    if hits:
        text, reason = text[: min(hits)], "stop"
        detok.text = text
    req.finish_reason = reason
    return RequestDelta(req.request_id, [token], text, reason, None, req.prompt_len, n_out,
                        None if logprob is None else [logprob], prompt_logprobs)  # fmt: skip
