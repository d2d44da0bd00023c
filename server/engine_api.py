"""The contract between the serving front end (HTTP, scheduling of requests onto the engine) and the EP runtime.

The runtime (``server/runtime/``) implements :class:`EngineCore`; the HTTP layer (``server/api/``) drives it from one
thread (``add_request`` / ``abort_request`` / ``step``) and never imports torch itself. Everything here is plain
Python so it can be pickled and unit-tested without workers.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

# A worker's token id for a request whose logits held NaN or Inf: the engine ends that request with this error.
NONFINITE_TOKEN = -1
NONFINITE_ERROR = (
    "the model produced non-finite logits (NaN or Inf) for this request, so it was ended; the "
    "weights or the dtype overflow for this input (try --dtype bfloat16 or float32)"
)
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for per position (vLLM's default limit)
LOGIT_BIAS_LIMIT = 100.0  # a logit bias is clamped to [-100, 100] (OpenAI's range; vLLM clamps likewise)


class SamplingParamError(ValueError):
    """A bad sampling parameter; ``param`` is its name (the HTTP layer answers 400 naming it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for the served tokenizer (:mod:`server.structured`): ``key`` names it (its kind and
    source: equal keys, equal grammars), ``data`` is xgrammar's serialized form, which the worker that samples the
    request turns into a matcher. ``json`` marks JSON grammars (raw control characters are never allowed in them)."""

    key: str
    data: str
    json: bool = False


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameter names. ``temperature == 0`` is greedy.

    ``n`` samples per prompt (sample ``i`` runs as :meth:`for_sample` ``(i)``: its own seed stream when ``seed`` is
    set). Penalties as vLLM: ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] subtract ``penalty`` once per
    token already generated (presence) or once per occurrence (frequency); ``repetition_penalty`` > 0 divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output; ``logit_bias``
    adds a bias (clamped to [-100, 100]) to a token id's logit; ``min_p`` in [0, 1] drops tokens whose probability
    is under ``min_p`` times the most likely one's. ``logprobs`` asks for the sampled token's log-probability and the
    ``logprobs`` most likely alternatives per generated token (0..20); ``prompt_logprobs`` the same per prompt token.
    ``grammar`` constrains the output to a compiled grammar (structured output): each step only tokens the grammar
    allows next can be sampled, and EOS only once the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, allowed: str) -> None:
            if not ok:
                raise SamplingParamError(param, f"must be {allowed}, got {getattr(self, param)!r}")

        check(self.max_tokens >= 1, "max_tokens", ">= 1")
        check(0 <= self.temperature < math.inf, "temperature", "a finite number >= 0")  # also refuses NaN
        check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "in [-2**63, 2**64) (a 64-bit integer)")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(self.top_k >= -1, "top_k", "-1 (disabled) or >= 0")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(self.n >= 1, "n", ">= 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "a finite number > 0")
        for param in ("logprobs", "prompt_logprobs"):
            value = getattr(self, param)
            check(value is None or 0 <= value <= MAX_LOGPROBS, param, f"None or in [0, {MAX_LOGPROBS}]")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0 or not -math.inf < bias < math.inf:
                    raise SamplingParamError(
                        "logit_bias", f"keys must be token ids >= 0 and values finite numbers, got {token!r}: {bias!r}"
                    )
            self.logit_bias = {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for t, b in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def needs_history(self) -> bool:
        """The sampler needs the request's token counts (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: ``n`` 1 and, when ``seed`` is set, seed ``seed + index``
        (wrapped into the 64-bit range), so each sample draws from its own stream."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed >= 2**64:
                seed -= 2**64
        return dataclasses.replace(self, n=1, seed=seed)


@dataclasses.dataclass
class TokenLogprob:
    """One position's log-probabilities: the token there (``token_id``, ``logprob``) and the ``top`` most likely
    tokens as ``(token_id, logprob)``, most likely first. Values are natural logs (float32 precision)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestDelta:
    """What one engine step produced for one request.

    ``new_token_ids`` are the tokens sampled this step (empty if the request only finished, e.g. aborted);
    ``finish_reason`` is None while running, else ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (max_tokens or max_model_len), ``"abort"`` or ``"error"`` (then ``error`` says why).
    ``text`` is the detokenized text of the whole output so far with any stop string and what follows cut off.
    ``logprobs`` (when the request asked for them) has one entry per new token; ``prompt_logprobs`` comes once, on
    the request's first token, one entry per prompt token (the first is None: nothing precedes it).
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    """Where a disaggregated request's two halves meet (SGLang's request fields): the prefill instance's bootstrap
    server at ``bootstrap_host:bootstrap_port`` and the request's ``bootstrap_room`` there."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: str


@dataclasses.dataclass
class KVTransferStat:
    """One request's KV transfer: ``direction`` ``"send"`` (prefill side) or ``"recv"`` (decode side), the prompt
    tokens and bytes moved and the seconds it took."""

    direction: str
    tokens: int
    num_bytes: int
    seconds: float


@dataclasses.dataclass
class StepStats:
    """What the last :meth:`EngineCore.step` did, for metrics: timings (seconds) of the whole step and, summed over
    MoE layers, each rank's time in dispatch and combine; queue sizes; the KV cache's use (the fraction of blocks
    held by requests, averaged over ranks) and, during this step, the preemptions and the prefix-cache queries and
    hits (in prompt tokens)."""

    step_time: float = 0.0
    dispatch_times: Sequence[float] = ()
    combine_times: Sequence[float] = ()
    num_running: int = 0
    num_waiting: int = 0
    num_lost_ranks: int = 0  # EP workers lost so far (elastic mode; their experts are dropped)
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    expert_loads: Mapping[int, Sequence[int]] = dataclasses.field(default_factory=dict)  # rank -> per MoE layer rows
    num_lost_experts: int = 0  # (layer, expert) pairs left without a replica by lost ranks (elastic mode)
    num_batched_tokens: int = 0  # tokens the step's forward processed on all ranks (prefill chunks and decodes)
    kv_transfers: Sequence[KVTransferStat] = ()  # KV transfers completed during the step (disaggregation)


class Tokenizer(abc.ABC):
    """Text <-> token ids for the served model, and what its chat template needs.

    ``eos_token_ids``: every id that ends generation; ``bos_token_id``: the BOS id (None: the model has none);
    ``special_tokens``: the named special tokens as strings (``bos_token``, ``eos_token``, ...: chat template
    variables); ``chat_template``: the checkpoint's template (a string, or ``{name: template}``), None when it ships
    none (chat is then refused unless the server is given one).
    """

    eos_token_ids: list[int]
    bos_token_id: int | None = None
    special_tokens: Mapping[str, str] = MappingProxyType({})
    chat_template: str | Mapping[str, str] | None = None

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` adds those the tokenizer puts around a text (e.g. BOS), as
        transformers' ``encode`` does."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str: ...

    def decode_with_special(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text with special tokens written out (tool-call parsers read their markers)."""
        return self.decode(token_ids)


class EngineCore(abc.ABC):
    """A running EP decode engine (W worker processes stepping in lockstep). Not thread-safe: one driver thread."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int  # per DP rank
    vocab_size: int | None = None  # the model's vocabulary size (None: unknown)

    @abc.abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        transfer: KVTransferParams | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next step. Raises ValueError for bad input.
        ``transfer``: the request's bootstrap room (a prefill or decode instance of a disaggregated deployment)."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Cancel a request (no-op if unknown or finished); its slot is freed at the next step."""

    @abc.abstractmethod
    def step(self) -> list[RequestDelta]:
        """Run one lockstep iteration over all workers and return what changed; raises if a worker failed."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """True while every worker process is alive and responsive."""

    def last_step_stats(self) -> StepStats:
        return StepStats()

    def disaggregation_info(self) -> dict | None:
        """A disaggregated instance's role (``{"mode": "prefill", "bootstrap_host", "bootstrap_port"}`` or
        ``{"mode": "decode"}``); None when colocated."""
        return None

    def failure(self) -> str | None:
        """Why the engine is unhealthy (one line for clients), if it knows; None while healthy."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop all workers (idempotent); no orphan processes."""
