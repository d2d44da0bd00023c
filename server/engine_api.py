"""The contract between the serving front end (HTTP, scheduling of requests onto the engine) and the EP runtime.

The runtime (``server/runtime/``) implements :class:`EngineCore`; the HTTP layer (``server/api/``) drives it from one
thread (``add_request`` / ``abort_request`` / ``step``) and never imports torch itself. Everything here is plain
Python so it can be pickled and unit-tested without workers.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameter names. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64) (a 64-bit integer), got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


@dataclasses.dataclass
class RequestDelta:
    """What one engine step produced for one request.

    ``new_token_ids`` are the tokens sampled this step (empty if the request only finished, e.g. aborted);
    ``finish_reason`` is None while running, else ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (max_tokens or max_model_len), ``"abort"`` or ``"error"`` (then ``error`` says why).
    ``text`` is the detokenized text of the whole output so far with any stop string and what follows cut off.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclasses.dataclass
class StepStats:
    """Timings of the last :meth:`EngineCore.step` (seconds) for metrics: the whole step and, summed over MoE
    layers and ranks' max, the time spent in dispatch and combine."""

    step_time: float = 0.0
    dispatch_times: Sequence[float] = ()
    combine_times: Sequence[float] = ()
    num_running: int = 0
    num_waiting: int = 0
    num_lost_ranks: int = 0  # EP workers lost so far (elastic mode; their experts are dropped)


class Tokenizer(abc.ABC):
    """Text <-> token ids for the served model."""

    eos_token_ids: list[int]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        """Token ids for a chat; the default joins ``role: content`` lines and ends with ``assistant:``."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)


class EngineCore(abc.ABC):
    """A running EP decode engine (W worker processes stepping in lockstep). Not thread-safe: one driver thread."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int  # per DP rank

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; it joins the running batch at the next step. Raises ValueError for bad input."""

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

    def failure(self) -> str | None:
        """Why the engine is unhealthy (one line for clients), if it knows; None while healthy."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop all workers (idempotent); no orphan processes."""
