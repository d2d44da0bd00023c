"""What the driver sends a worker each step (:class:`StepPlan`) and what comes back (:class:`StepResult`)."""

from __future__ import annotations

import dataclasses

from ..disagg.transfer import KVPull, PullResult
from ..engine_api import SamplingParams, TokenLogprob


@dataclasses.dataclass
class PlanEntry:
    """One sequence's tokens this step.

    ``token_ids`` go to positions ``[start, start + len(token_ids))``; None stands for the one token this worker
    sampled for the sequence last (the driver planned the step before that token reached it). ``sample`` asks for
    a new token. ``params`` comes with a request's first entry (it creates the sequence's sampler on the worker).
    ``new_block_ids`` are cache blocks appended to the sequence's block table, or, with ``reset_blocks``, its whole
    new table (a request starting over after preemption, or its first entry).
    """

    seq_id: int
    start: int
    token_ids: list[int] | None
    sample: bool
    params: SamplingParams | None = None
    new_block_ids: list[int] = dataclasses.field(default_factory=list)
    reset_blocks: bool = False


@dataclasses.dataclass
class StepPlan:
    """A worker's step: its entries, the sequences it can forget (finished or aborted since its last plan), and
    the step's token count summed over every worker (bounds what an MoE layer receives); a decode instance's
    ``pulls`` read prompts' KV from prefill instances before the forward."""

    entries: list[PlanEntry]
    finished_seq_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens_all_ranks: int | None = None
    pulls: list[KVPull] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(1 if e.token_ids is None else len(e.token_ids) for e in self.entries)


@dataclasses.dataclass
class StepResult:
    """Sampled ids in the order of the plan's sampling entries, and this rank's timings (seconds). Per sampled id:
    its log-probabilities (None unless asked for) and, on a request's first sample, its prompt's (None unless asked
    for)."""

    token_ids: list[int]
    forward_time: float
    dispatch_time: float
    combine_time: float
    logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob | None] | None] = dataclasses.field(default_factory=list)
    expert_load: list[int] = dataclasses.field(default_factory=list)  # per MoE layer: rows this rank's experts got
    num_lost_experts: int = 0  # (MoE layer, expert) pairs with no replica left after lost ranks
    regroup: str = ""  # why the EP group must regroup although this step finished (its EPLB exchange failed)
    pulls: list[PullResult] = dataclasses.field(default_factory=list)  # the plan's pulls, in order
