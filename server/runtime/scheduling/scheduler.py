"""Per-DP-rank request scheduling over a paged KV cache (pure Python; runs in the driver).

Each worker owns its requests and its KV-cache blocks
(:class:`~server.runtime.scheduling.block_manager.KVCacheManager`).
A step first gives every running request in decode one token, then fills the rest of the rank's per-step token
capacity N (``max_num_batched_tokens``) with prefill chunks (chunked prefill), then admits waiting requests while
``max_num_seqs`` allows and their blocks are there (after their cached prefix, if prefix caching found one). When
a running request needs a block and none is free, the most recently admitted request not yet planned this step is
preempted: its blocks are released and it waits at the head of the queue to be recomputed (prompt and output so
far as one prefill), which gives the same tokens as running uninterrupted. A step that preempted admits nothing
(as vLLM: the blocks just freed would be handed straight back).

With async scheduling the driver plans step k+1 while the workers run step k: a request whose token of step k is
still in flight (``num_inflight``) gets a placeholder for it (the worker fills in what it sampled), and is not
planned past ``max_tokens`` or ``max_model_len`` counting that token.
"""

from __future__ import annotations

import collections

from server.disagg.transfer import KVPull
from server.runtime.scheduling.block_manager import KVCacheManager
from server.runtime.scheduling.plan import PlanEntry, StepPlan
from server.runtime.scheduling.request import Request


class RankScheduler:
    """Requests of one DP rank: ``waiting`` (no blocks, FIFO; preempted ones go back to the head) and ``running``
    (hold blocks, in admission order)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, num_max_tokens: int, max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs, self.num_max_tokens, self.max_model_len = max_num_seqs, num_max_tokens, max_model_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.finished_seq_ids: list[int] = []  # removed since the last plan sent (the worker can forget them)
        self.pulls: list[KVPull] = []  # KV to read before the next plan's forward (a decode instance)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[StepPlan, list[Request]]:
        """This step's plan and, in plan order, the request of each entry that samples a token."""
        plan = StepPlan([], pulls=self.pulls)
        self.pulls = []
        sampling: list[Request] = []
        planned: set[int] = set()
        preempted: set[int] = set()
        budget = self.num_max_tokens
        for decodes in (True, False):  # decodes first: one token each (max_num_seqs <= N, so they always fit)
            for req in list(self.running):
                n = min(req.num_schedulable(self.max_model_len), budget)
                if n == 0 or req.seq_id in planned or req.seq_id in preempted or (req.num_pending == 1) != decodes:
                    continue
                if self._reserve(req, req.num_computed + n, planned, preempted):
                    budget -= self._plan(plan, sampling, req, n)
                    planned.add(req.seq_id)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0 and not preempted:
            req = self.waiting[0]
            admitted = self.kv.admit(req.table, req.token_ids, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.num_computed = admitted
            budget -= self._plan(plan, sampling, req, min(len(req.token_ids) - admitted, budget))
        return plan, sampling

    def admit_transferred(self, req: Request) -> int | None:
        """A decode instance: give ``req`` (its prompt's KV to come from a prefill instance) blocks for its whole
        prompt, running; returns how many prompt tokens its prefix cache already holds, or None (nothing changed)
        when the blocks or a running slot are not there."""
        if len(self.running) >= self.max_num_seqs:
            return None
        num_cached = self.kv.admit(req.table, req.token_ids, len(req.token_ids))
        if num_cached is not None:
            self.running.append(req)
        return num_cached

    def remove(self, req: Request, free_blocks: bool = True) -> None:
        """Drop a finished or aborted request and release its blocks (``free_blocks`` False: the caller keeps
        holding them, e.g. a prefill instance until its decode instance has pulled them)."""
        if req in self.running:
            self.kv.cache_full_blocks(req.table, req.token_ids, req.num_computed)
            if free_blocks:
                self.kv.free(req.table)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.started:
            self.finished_seq_ids.append(req.seq_id)

    def _reserve(self, req: Request, num_tokens: int, planned: set[int], preempted: set[int]) -> bool:
        """Blocks for ``num_tokens`` of ``req``, preempting the latest admitted unplanned requests as needed (their
        ids go to ``preempted``); False when ``req`` itself had to be preempted."""
        while not self.kv.grow(req.table, num_tokens):
            victim = next((r for r in reversed(self.running) if r is not req and r.seq_id not in planned), req)
            self._preempt(victim)
            preempted.add(victim.seq_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Release ``req``'s blocks and queue it first, to be recomputed from its prompt and output so far."""
        self.kv.free(req.table)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _plan(self, plan: StepPlan, sampling: list[Request], req: Request, n: int) -> int:
        """Add ``n`` tokens of ``req`` (blocks reserved) to ``plan``; returns ``n``."""
        start = req.num_computed
        in_flight = req.num_pending == 1 and req.num_inflight > 0  # its input is in flight: the worker has it
        tokens = None if in_flight else req.token_ids[start : start + n]
        sample = start + n == len(req.token_ids) + req.num_inflight
        new_blocks, reset = req.table.take_new()
        plan.entries.append(
            PlanEntry(req.seq_id, start, tokens, sample, None if req.started else req.params, new_blocks, reset)
        )
        req.started = True
        req.num_computed += n
        self.kv.cache_full_blocks(req.table, req.token_ids, req.num_computed)
        if sample:
            req.num_inflight += 1
            sampling.append(req)
        return n
