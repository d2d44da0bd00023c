"""One request on its DP rank (:class:`Request`: prompt, output so far, sampling parameters, KV-cache blocks) and what
a sampled token does to it (:func:`apply_token`: the text grows, the stop rules decide whether it finished)."""

from __future__ import annotations

import dataclasses

from server.engine_api import NONFINITE_ERROR, NONFINITE_TOKEN, RequestDelta, SamplingParams, TokenLogprob
from server.runtime.scheduling.block_manager import BlockTable
from server.runtime.scheduling.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass(eq=False)
class Request:
    """One request on its rank. ``token_ids`` is the prompt followed by the output so far; ``num_computed`` tokens
    of it have their keys/values in the cache (or planned); ``num_inflight`` tokens are being sampled by steps whose
    results have not arrived."""

    request_id: str
    seq_id: int
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_computed: int = 0
    num_inflight: int = 0
    started: bool = False  # the worker has this request's sampling params
    finish_reason: str | None = None
    table: BlockTable = dataclasses.field(default_factory=BlockTable)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens (in flight included) whose keys/values are not computed yet."""
        return len(self.token_ids) + self.num_inflight - self.num_computed

    def num_schedulable(self, max_model_len: int) -> int:
        """Tokens it can run now: 1 in decode, else its known uncomputed tokens; 0 once its last token is planned
        (``max_tokens`` or ``max_model_len`` reached, counting in-flight tokens)."""
        total = len(self.token_ids) + self.num_inflight
        if self.num_pending == 1:
            return int(total - self.prompt_len < self.params.max_tokens and total < max_model_len)
        return len(self.token_ids) - self.num_computed


def apply_token(
    req: Request,
    token: int,
    max_model_len: int,
    logprob: TokenLogprob | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> RequestDelta:
    """Append a sampled token, extend the text and decide whether the request finished (vLLM semantics: EOS and
    stop token ids are kept in ``token_ids`` but not in the text; a stop string and what follows are cut off).
    ``logprob`` and ``prompt_logprobs`` (the worker's, when asked for) go into the delta; ``NONFINITE_TOKEN`` (the
    worker found NaN / Inf in the request's logits) ends it with an error."""
    if token == NONFINITE_TOKEN:
        req.finish_reason = "error"
        return RequestDelta(
            req.request_id, [], req.detokenizer.text, "error", NONFINITE_ERROR, req.prompt_len, req.num_output
        )
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
    return RequestDelta(
        req.request_id,
        [token],
        text,
        reason,
        None,
        req.prompt_len,
        n_out,
        None if logprob is None else [logprob],
        prompt_logprobs,
    )
