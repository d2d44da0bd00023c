"""``EPEngine``: the :class:`~server.engine_api.EngineCore` over W lockstep EP workers (DP attention + EP MoE)."""

from __future__ import annotations

import time
import weakref
from typing import Any

from ..engine_api import EngineCore, RequestDelta, SamplingParamError, SamplingParams, StepStats
from ..loader import random_hf_config, read_config
from ..models import ModelConfig
from ..tokenizer import load_tokenizer
from .engine_config import DEFAULT_STEP_TIMEOUT_S, EngineConfig, default_capacity
from .scheduler import RankScheduler, Request, apply_token
from .worker import StepPlan
from .workers import ProcessWorkers, TorchrunWorkers, WorkerError, WorkerGroup

__all__ = ["DEFAULT_STEP_TIMEOUT_S", "EPEngine", "EngineConfig", "default_capacity"]


class EPEngine(EngineCore):
    """W workers stepping in lockstep; each owns its requests and KV cache (``max_num_seqs`` per worker).

    Takes one :class:`~server.runtime.engine_config.EngineConfig` (``EPEngine(config)``), or its fields as keywords
    (``EPEngine(model=..., ep_size=2)``), which are validated there. Launch ``spawn`` starts ``ep_size`` local
    workers; ``torchrun`` makes this process rank 0 of a torchrun job (worker 0, the others run
    :func:`~server.runtime.workers.run_worker_from_env`). ``step_timeout_s`` is how long one lockstep step (or a
    health ping) may take before the engine declares the workers hung, stops them and fails (spawned workers; a dead
    worker is noticed at once); ``elastic`` (spawned workers) keeps serving on the survivors when a worker dies or
    hangs: its requests end with ``"error"``, its experts are dropped (the Buffers' shrink mode: tokens routed to
    them get nothing from them), the loss is logged and counted in :class:`StepStats`; the Buffers' collective
    timeout is then ``step_timeout_s / 3``. The device / backend combination is checked
    (:meth:`EngineConfig.check_placement`) before any worker starts.
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
        if not config.use_torchrun and cfg.num_experts % config.ep_size != 0:
            raise ValueError(f"ep_size={config.ep_size} must divide the model's num_experts={cfg.num_experts}")
        self.config = config
        self.model_config = cfg
        self.tokenizer = load_tokenizer(config.model, cfg.eos_token_ids)
        self.max_model_len = config.max_model_len
        self.vocab_size = cfg.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.workers: WorkerGroup = TorchrunWorkers(config) if config.use_torchrun else ProcessWorkers(config)
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        self.ep_size = len(self.workers.infos)
        self.schedulers = [RankScheduler(config.max_num_seqs, config.capacity) for _ in range(self.ep_size)]
        self._requests: dict[str, tuple[int, Request]] = {}
        self._aborts: list[str] = []
        self._stats = StepStats()
        self._error: str | None = None
        self._failed_ranks: set[int] = set()  # lost workers whose requests have been failed
        self.ping_timeout_s = min(config.step_timeout_s, 5.0)

    @property
    def worker_infos(self) -> list[dict]:
        """Per worker: peak RSS after loading, expert/weight/KV-cache bytes, number of local experts."""
        return self.workers.infos

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise SamplingParamError("n", f"the engine runs one sample per request, got {params.n}; add one request "
                                     "per SamplingParams.for_sample(i)")  # fmt: skip
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
        live = [r for r in range(self.ep_size) if r not in self.workers.lost]
        rank = min(live, key=lambda r: self.schedulers[r].num_requests)
        req = Request(request_id, list(prompt_token_ids), params)
        self.schedulers[rank].waiting.append(req)
        self._requests[request_id] = (rank, req)

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
                self.schedulers[rank].remove(req)
                deltas.append(
                    RequestDelta(
                        request_id, [], req.text, "abort", None, len(req.prompt_token_ids), len(req.output_token_ids)
                    )
                )
        self._aborts.clear()
        scheduled = [s.schedule() for s in self.schedulers]
        plans: list[StepPlan] = [plan for plan, _ in scheduled]
        if not any(plan.entries for plan in plans):
            return deltas
        try:
            results = self.workers.step(plans)
        except WorkerError as e:
            self._error = str(e).splitlines()[0]
            self.workers.shutdown()
            raise
        deltas += self._fail_lost_ranks()
        for rank, ((_, sampling), result) in enumerate(zip(scheduled, results, strict=True)):
            if result is None:  # lost this step (elastic mode): its requests were just failed
                continue
            logprobs = result.logprobs or [None] * len(sampling)
            prompt_logprobs = result.prompt_logprobs or [None] * len(sampling)
            for req, token, logprob, prompt in zip(sampling, result.token_ids, logprobs, prompt_logprobs, strict=True):
                delta = apply_token(req, token, self.tokenizer, self.max_model_len, logprob, prompt)
                if delta.finish_reason is not None:
                    self.schedulers[rank].remove(req)
                    del self._requests[req.request_id]
                deltas.append(delta)
        self._stats = StepStats(
            step_time=time.perf_counter() - t0,
            dispatch_times=[r.dispatch_time for r in results if r is not None],
            combine_times=[r.combine_time for r in results if r is not None],
            num_running=sum(len(s.running) for s in self.schedulers),
            num_waiting=sum(len(s.waiting) for s in self.schedulers),
            num_lost_ranks=len(self.workers.lost),
        )
        return deltas

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
                    self.schedulers[rank].remove(req)
                    deltas.append(RequestDelta(request_id, [], req.text, "error", error, len(req.prompt_token_ids),
                                               len(req.output_token_ids)))  # fmt: skip
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

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
