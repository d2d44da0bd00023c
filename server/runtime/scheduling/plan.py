"""What a worker tells the driver once it is ready (:class:`WorkerInfo`), what the driver sends it each step
(:class:`StepPlan`) and what comes back (:class:`StepResult`)."""

from __future__ import annotations

import dataclasses

from server.disagg.transfer import KVPull, PullResult
from server.engine_api import SamplingParams, TokenLogprob


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


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker's ``("ready", info)`` report: memory (bytes: resident before loading, peak after; its experts', all
    its weights' and its KV cache's), the KV cache's blocks and how its budget was chosen, its local experts, the
    device it bound and the Buffer backend its MoE layers run on (``"local"``: EP 1, in-process dispatch); with
    disaggregation, where other instances read its KV cache (the transfer segment, each cache tensor's address and
    bytes per block)."""

    rank: int
    rss_before_load: int
    peak_rss_after_load: int
    expert_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    kv_budget_source: str
    num_local_experts: int
    device: str
    moe_backend: str
    kv_segment: str = ""
    kv_bases: list[int] = dataclasses.field(default_factory=list)
    kv_block_bytes: list[int] = dataclasses.field(default_factory=list)
