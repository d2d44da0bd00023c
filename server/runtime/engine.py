"""``EPEngine``: the :class:`~server.engine_api.EngineCore` over W lockstep EP workers (DP attention + EP MoE)."""

from __future__ import annotations

import collections
import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from server.engine_api import EngineCore, KVTransferParams, RequestDelta, SamplingParamError, SamplingParams, StepStats
from server.loader import DTYPES, random_hf_config, read_config
from server.models import ModelConfig
from server.models.kv_cache import bytes_per_block
from server.models.moe import fused_refusal
from server.runtime.engine_config import DEFAULT_STEP_TIMEOUT_S, EngineConfig, default_capacity
from server.runtime.expert_placement import build_expert_map, uses_placement
from server.runtime.scheduling.block_manager import KVCacheManager
from server.runtime.scheduling.detokenizer import IncrementalDetokenizer
from server.runtime.scheduling.kv_budget import check_fits, mib
from server.runtime.scheduling.plan import StepResult, WorkerInfo
from server.runtime.scheduling.request import Request, apply_token
from server.runtime.scheduling.scheduler import RankScheduler
from server.runtime.workers.group import ProcessWorkers, WorkerError, WorkerGroup
from server.runtime.workers.torchrun import TorchrunWorkers
from server.tokenizer import load_tokenizer

_T = TypeVar("_T")

__all__ = ["DEFAULT_STEP_TIMEOUT_S", "EPEngine", "EngineConfig", "default_capacity"]


class EPEngine(EngineCore):
    """W workers stepping in lockstep; each owns its requests and KV cache (``max_num_seqs`` per worker).

    Takes one :class:`~server.runtime.engine_config.EngineConfig` (``EPEngine(config)``), or its fields as keywords
    (``EPEngine(model=..., ep_size=2)``), which are validated there. Launch ``spawn`` starts ``ep_size`` local
    workers; ``torchrun`` makes this process rank 0 of a torchrun job (worker 0, the others run
    :func:`~server.runtime.workers.torchrun.run_worker_from_env`). ``step_timeout_s`` is how long one lockstep step
    (or a health ping) may take before the engine declares the workers hung, stops them and fails (a dead worker is
    noticed at once); ``elastic`` keeps serving on the survivors when a worker dies, hangs or is cut off: its
    requests end with ``"error"``, the survivors regroup at the step boundary and run the interrupted step again
    without it (:meth:`~server.runtime.workers.group.WorkerGroup._settle`), its experts are dropped unless replicas
    live elsewhere, the loss is logged and counted in :class:`StepStats`; the Buffers' collective timeout is then
    ``step_timeout_s / 3``. The device / backend combination is checked
    (:meth:`EngineConfig.check_placement`) before any worker starts, and the KV cache's size once they have loaded
    their weights (:mod:`server.runtime.scheduling.kv_budget`; a ``ValueError`` says what fits and what was asked).

    With ``async_scheduling`` (spawned workers) :meth:`step` plans and submits step k+1, then collects step k: the
    workers run k+1 while the driver turns k's tokens into text and plans k+2.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError(
                f"EPEngine takes an EngineConfig or its fields as keywords, not both (got {sorted(kwargs)})"
            )
        config = EngineConfig(**kwargs) if config is None else config
        config.check_placement()
        cfg = (
            read_config(config.model)
            if config.model is not None
            else ModelConfig.from_hf(random_hf_config(config.random_model))
        )
        if config.moe_impl == "fused" and (why := fused_refusal(cfg)):
            raise ValueError(why)
        if uses_placement(config):  # a bad placement stops start-up here, before any worker starts
            build_expert_map(config, cfg, config.ep_size)
        elif not config.use_torchrun and cfg.num_experts % config.ep_size != 0:
            raise ValueError(
                f"ep_size={config.ep_size} must divide the model's num_experts={cfg.num_experts} (or "
                "add redundant expert slots: --num-redundant-experts / --expert-placement)"
            )
        self.config = config
        self.model_config = cfg
        block_bytes = bytes_per_block(cfg, config.block_size, DTYPES[config.dtype])
        if config.kv_cache_memory is not None:  # refuse before starting any worker
            check_fits(
                config.kv_cache_memory // block_bytes,
                config.block_size,
                block_bytes,
                config.max_model_len,
                f"kv-cache-memory {mib(config.kv_cache_memory)}",
            )
        self.tokenizer = load_tokenizer(config.model, cfg.eos_token_ids)
        self.max_model_len = config.max_model_len
        self.vocab_size = cfg.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.workers: WorkerGroup = TorchrunWorkers(config) if config.use_torchrun else ProcessWorkers(config)
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        self.ep_size = len(self.workers.infos)
        smallest = min(self.workers.infos, key=lambda info: info.num_kv_blocks)
        try:
            check_fits(
                smallest.num_kv_blocks,
                config.block_size,
                block_bytes,
                config.max_model_len,
                f"worker {smallest.rank}'s budget ({smallest.kv_budget_source})",
            )
        except ValueError:
            self.shutdown()
            raise
        self.schedulers = [
            RankScheduler(
                KVCacheManager(info.num_kv_blocks, config.block_size, config.enable_prefix_caching),
                config.max_num_seqs,
                config.capacity,
                config.max_model_len,
            )
            for info in self.workers.infos
        ]
        self._requests: dict[str, tuple[int, Request]] = {}
        self._seq_ids = itertools.count()
        self._aborts: list[str] = []
        # per submitted step not collected yet: the sampling requests of each rank, in plan order
        self._inflight: collections.deque[list[list[Request]]] = collections.deque()
        self._pipeline_depth = int(config.async_scheduling and self.workers.overlaps)
        self._stats = StepStats()
        self._counted = (0, 0, 0)  # preemptions, prefix-cache queries and hits reported so far
        self._error: str | None = None
        self._failed_ranks: set[int] = set()  # lost workers whose requests have been failed
        self._num_batched = 0  # tokens submitted by the last step
        self.ping_timeout_s = min(config.step_timeout_s, 5.0)

    @property
    def worker_infos(self) -> list[WorkerInfo]:
        """Per worker: peak RSS after loading, expert/weight/KV-cache bytes, KV blocks, number of local experts."""
        return self.workers.infos

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        transfer: KVTransferParams | None = None,
    ) -> None:
        if transfer is not None:
            raise ValueError(
                "bootstrap_room: this server runs colocated (no --disaggregation-mode); send requests "
                "without bootstrap fields"
            )
        req = self._new_request(request_id, prompt_token_ids, params)
        rank = self._pick_rank(prompt_token_ids)
        self.schedulers[rank].waiting.append(req)
        self._requests[request_id] = (rank, req)

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """A checked new request (``ValueError`` / ``TypeError`` for bad input), on no rank yet."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise SamplingParamError(
                "n",
                f"the engine runs one sample per request, got {params.n}; add one request "
                "per SamplingParams.for_sample(i)",
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise SamplingParamError("logit_bias", f"token id {bad[0]} is not in [0, {vocab}) (vocab_size)")
        if not prompt_token_ids or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ints in [0, {vocab}) (vocab_size)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len={self.max_model_len} leaves room for "
                f"at most {self.max_model_len - 1}"
            )
        return Request(
            request_id,
            next(self._seq_ids),
            len(prompt_token_ids),
            list(prompt_token_ids),
            params,
            IncrementalDetokenizer(self.tokenizer),
        )

    def _pick_rank(self, prompt_token_ids: list[int]) -> int:
        """The live rank with the fewest requests; among those, the one with the longest cached prefix."""
        live = [r for r in range(self.ep_size) if r not in self.workers.lost]
        scheds = self.schedulers
        return min(live, key=lambda r: (scheds[r].num_requests, -len(scheds[r].kv.match_prefix(prompt_token_ids)[0])))

    def abort_request(self, request_id: str) -> None:
        if request_id in self._requests:
            self._aborts.append(request_id)

    def step(self) -> list[RequestDelta]:
        if self._error is not None:
            raise WorkerError(f"the engine has failed: {self._error}")
        t0 = time.perf_counter()
        deltas = self._fail_lost_ranks()
        for request_id in self._aborts:
            if request_id in self._requests:
                rank, req = self._requests.pop(request_id)
                req.finish_reason = "abort"
                delta = RequestDelta(
                    request_id, [], req.detokenizer.text, "abort", None, req.prompt_len, req.num_output
                )
                self._end(rank, req, delta)
                deltas.append(delta)
        self._aborts.clear()
        scheduled = [s.schedule() for s in self.schedulers]
        plans = [plan for plan, _ in scheduled]
        submitted = any(plan.entries or plan.pulls for plan in plans)
        if submitted:
            total = sum(plan.num_tokens for plan in plans)
            for plan, sched in zip(plans, self.schedulers, strict=True):
                plan.num_tokens_all_ranks = total
                plan.finished_seq_ids, sched.finished_seq_ids = sched.finished_seq_ids, []
            self._guard(lambda: self.workers.submit(plans))
            self._inflight.append([sampling for _, sampling in scheduled])
        self._num_batched = sum(plan.num_tokens for plan in plans)
        results: list[StepResult | None] = []
        if self._inflight and (len(self._inflight) > self._pipeline_depth or not submitted):
            results = self._guard(self.workers.collect)
            deltas += self._fail_lost_ranks()
            deltas += self._apply_results(self._inflight.popleft(), results)
        self._stats = self._step_stats(time.perf_counter() - t0, results)
        return deltas

    def _guard(self, call: Callable[[], _T]) -> _T:
        """``call()``; a worker failure fails the engine for good (the workers are stopped)."""
        try:
            return call()
        except WorkerError as e:
            self._error = str(e).splitlines()[0]
            self.workers.shutdown()
            raise

    def _apply_results(self, sampling: list[list[Request]], results: list[StepResult | None]) -> list[RequestDelta]:
        deltas = []
        for rank, (reqs, result) in enumerate(zip(sampling, results, strict=True)):
            if result is None:  # lost this step (elastic mode): its requests were just failed
                continue
            logprobs = result.logprobs or [None] * len(reqs)
            prompt_logprobs = result.prompt_logprobs or [None] * len(reqs)
            for req, token, logprob, prompt in zip(reqs, result.token_ids, logprobs, prompt_logprobs, strict=True):
                req.num_inflight -= 1
                if req.finish_reason is not None:  # finished or aborted while this token was in flight
                    continue
                delta = apply_token(req, token, self.max_model_len, logprob, prompt)
                if delta.finish_reason is not None:
                    self._end(rank, req, delta)
                    del self._requests[req.request_id]
                deltas.append(delta)
        return deltas

    def _end(self, rank: int, req: Request, delta: RequestDelta) -> None:
        """``req`` on ``rank`` ended as ``delta`` says: release it (a prefill instance parks its blocks instead)."""
        self.schedulers[rank].remove(req)

    def _step_stats(self, step_time: float, results: list[StepResult | None]) -> StepStats:
        live = [s for r, s in enumerate(self.schedulers) if r not in self.workers.lost] or self.schedulers
        counted = (
            sum(s.num_preemptions for s in self.schedulers),
            sum(s.kv.num_queries for s in self.schedulers),
            sum(s.kv.num_hits for s in self.schedulers),
        )
        new = [now - before for now, before in zip(counted, self._counted, strict=True)]
        self._counted = counted
        return StepStats(
            step_time=step_time,
            dispatch_times=[r.dispatch_time for r in results if r is not None],
            combine_times=[r.combine_time for r in results if r is not None],
            num_running=sum(len(s.running) for s in self.schedulers),
            num_waiting=sum(len(s.waiting) for s in self.schedulers),
            num_lost_ranks=len(self.workers.lost),
            kv_cache_usage=sum(s.kv.usage for s in live) / len(live),
            num_preemptions=new[0],
            prefix_cache_queries=new[1],
            prefix_cache_hits=new[2],
            expert_loads={r: res.expert_load for r, res in enumerate(results) if res is not None and res.expert_load},
            num_lost_experts=max((r.num_lost_experts for r in results if r is not None), default=0),
            num_batched_tokens=self._num_batched,
        )

    def _fail_lost_ranks(self) -> list[RequestDelta]:
        """Elastic mode: end the requests of newly lost workers with an error (their KV cache is gone)."""
        deltas = []
        for rank, why in self.workers.lost.items():
            if rank in self._failed_ranks:
                continue
            self._failed_ranks.add(rank)
            error = f"EP worker {rank} was lost ({why}); this request ran on it. Serving continues without it"
            for request_id, (r, req) in list(self._requests.items()):
                if r == rank:
                    del self._requests[request_id]
                    req.finish_reason = "error"
                    delta = RequestDelta(
                        request_id, [], req.detokenizer.text, "error", error, req.prompt_len, req.num_output
                    )
                    self._end(rank, req, delta)
                    deltas.append(delta)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._inflight)

    def is_healthy(self) -> bool:
        """Every worker process is alive and answers a ping within ``min(step_timeout_s, 5)`` seconds (call it
        between steps, from the driver thread). A failed check stops the workers: the engine stays failed."""
        if self._error is None:
            try:
                self.workers.ping(self.ping_timeout_s)
            except WorkerError as e:
                self._error = str(e).splitlines()[0]
                self.workers.shutdown()
        return self._error is None

    def last_step_stats(self) -> StepStats:
        return self._stats

    def failure(self) -> str | None:
        return self._error

    def shutdown(self) -> None:
        self._finalizer()
