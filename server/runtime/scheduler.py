"""Per-DP-rank request scheduling and stop handling (pure Python; runs in the driver).

Each worker owns its requests and KV-cache slots. A step gives every running request in decode one token, then
fills the rest of the rank's per-step capacity N (``num_max_dispatch_tokens_per_rank``) with prefill chunks
(chunked prefill), admitting waiting requests while a slot is free.
"""

from __future__ import annotations

import collections
import dataclasses

from ..engine_api import NONFINITE_ERROR, NONFINITE_TOKEN, RequestDelta, SamplingParams, Tokenizer, TokenLogprob
from .worker import PlanEntry, StepPlan


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the cache
    slot: int | None = None
    started: bool = False  # the worker has this request's sampling params
    text: str = ""
    finish_reason: str | None = None

    @property
    def num_pending(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed

    def pending_tokens(self, n: int) -> list[int]:
        tokens = self.prompt_token_ids + self.output_token_ids
        return tokens[self.num_computed : self.num_computed + n]


class RankScheduler:
    """Requests of one DP rank: ``waiting`` (no slot yet) and ``running`` (own a cache slot)."""

    def __init__(self, max_num_seqs: int, num_max_tokens: int) -> None:
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_max_tokens = num_max_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[StepPlan, list[Request]]:
        """This step's plan and, in plan order, the request of each entry that samples a token."""
        budget = self.num_max_tokens
        entries: list[PlanEntry] = []
        sampling: list[Request] = []

        def take(req: Request, n: int) -> None:
            nonlocal budget
            sample = n == req.num_pending
            params = None if req.started else req.params
            assert req.slot is not None, "running requests own a slot"
            entries.append(PlanEntry(req.slot, req.num_computed, req.pending_tokens(n), sample, params))
            req.started = True
            req.num_computed += n
            budget -= n
            if sample:
                sampling.append(req)

        for req in self.running:  # decodes first: one token each (max_num_seqs <= N, so they always fit)
            if req.num_pending == 1 and budget > 0:
                take(req, 1)
        for req in self.running:  # then prefill chunks
            if req.num_pending > 1 and budget > 0:
                take(req, min(req.num_pending, budget))
        while self.waiting and self.free_slots and budget > 0:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            self.running.append(req)
            take(req, min(req.num_pending, budget))
        return StepPlan(entries), sampling

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            assert req.slot is not None, "running requests own a slot"
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)


def apply_token(req: Request, token: int, tokenizer: Tokenizer, max_model_len: int,
                logprob: TokenLogprob | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestDelta:  # fmt: skip
    """Append a sampled token, update the text and decide whether the request finished (vLLM semantics: EOS and
    stop token ids are kept in ``token_ids`` but not in the text; a stop string and what follows are cut off).
    ``logprob`` and ``prompt_logprobs`` (the worker's, when asked for) go into the delta."""
    if token == NONFINITE_TOKEN:  # the worker found NaN / Inf in this request's logits
        req.finish_reason = "error"
        return RequestDelta(req.request_id, [], req.text, "error", NONFINITE_ERROR, len(req.prompt_token_ids),
                            len(req.output_token_ids))  # fmt: skip
    req.output_token_ids.append(token)
    p = req.params
    n_out = len(req.output_token_ids)
    reason = None
    text_ids = req.output_token_ids
    if token in (p.stop_token_ids or []) or (not p.ignore_eos and token in tokenizer.eos_token_ids):
        reason, text_ids = "stop", req.output_token_ids[:-1]
    text = tokenizer.decode(text_ids)
    hits = [i for i in (text.find(s) for s in p.stop_strings if s) if i >= 0]
    if hits:
        text, reason = text[: min(hits)], "stop"
    if reason is None and (n_out >= p.max_tokens or len(req.prompt_token_ids) + n_out >= max_model_len):
        reason = "length"
    req.text, req.finish_reason = text, reason
    return RequestDelta(req.request_id, [token], text, reason, None, len(req.prompt_token_ids), n_out,
                        None if logprob is None else [logprob], prompt_logprobs)  # fmt: skip
