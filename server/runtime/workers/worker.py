"""One EP decode worker: its model shard (all shared weights + its own experts), paged KV cache and per-sequence
state (block table, sampler, last sampled token).

A worker owns the requests the driver placed on it (DP attention). Every step it receives a :class:`StepPlan`
(possibly empty: it still enters every MoE dispatch/combine with zero tokens), runs one forward, samples and
returns the new token ids (:mod:`server.runtime.workers.worker_loop` runs it).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import Any

import torch

from deep_ep_npu import EPRankFailure
from deep_ep_npu.kernels import expert_mm
from server.disagg.transfer import KVPull, PullResult, TransferBackend, cache_tensors, make_backend, run_pull
from server.engine_api import NONFINITE_TOKEN, SamplingParams
from server.loader import DTYPES, load_model
from server.models import ForwardBatch, LocalComm, ModelConfig, PagedKVCache, SeqInput
from server.models.buffer_comm import BufferComm
from server.models.ep_comm import ExpertComm
from server.models.kv_cache import bytes_per_block
from server.models.two_batch import micro_batches
from server.runtime.engine_config import EngineConfig
from server.runtime.expert_placement import build_expert_map
from server.runtime.sampling.grammar import WorkerGrammars, mask_rows
from server.runtime.sampling.request_sampler import RequestSampler
from server.runtime.scheduling.kv_budget import kv_budget_bytes
from server.runtime.scheduling.plan import PlanEntry, StepPlan, StepResult, WorkerInfo
from server.runtime.workers.rebalance import Rebalancer
from server.tokenizer import load_tokenizer

__all__ = ["PlanEntry", "StepAborted", "StepPlan", "StepResult", "Worker"]


THREADED_STEP_TOKENS = 64
"""A CPU worker's step of at most this many tokens runs torch on one thread (when ``worker_threads`` is not set): such
a step reads weights, which ``expert_mm`` does on all the worker's threads anyway, and a second torch thread costs
more in wake-ups than it gives back on the step's hundreds of small ops (measured in-process on the decode benchmark's
model, 2 cores: batch 1 step 9.3 ms with torch on one thread, 12 ms on two; a 32- or 64-token prefill equal, 128
tokens 1.4x faster on two)."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class _Seq:
    sampler: RequestSampler
    block_table: list[int] = dataclasses.field(default_factory=list)
    last_token: int = -1  # the token sampled last (a placeholder entry's input)


@dataclasses.dataclass
class _Step:
    """The step a worker ran last, kept until the next plan: the driver may have it run again
    (:meth:`Worker.regroup`)."""

    seqs: list[_Seq]
    inputs: list[SeqInput]
    batch: ForwardBatch
    pulls: list[PullResult]  # the plan's KV pulls (done once, before the first forward)
    result: StepResult | None = None  # set once sampled: a re-run keeps these tokens


class StepAborted(Exception):
    """A rank failure (``EPRankFailure``) interrupted this step's forward on this worker: nothing was sampled. The
    driver decides who is left and has every survivor run the step again (:meth:`Worker.regroup`)."""


class Worker:
    """The model shard of EP rank ``rank`` of ``world_size``, its KV cache and its sequences."""

    def __init__(self, args: EngineConfig, rank: int, world_size: int, group: Any = None, device: Any = None) -> None:
        """``device``: the ``torch.device`` this worker bound (:func:`~server.runtime.workers.placement.bind_device`);
        None: the CPU. Builds the KV cache from the memory budget once the weights are in (see
        :mod:`server.runtime.scheduling.kv_budget`); the driver checks that it holds a full-length request."""
        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = torch.device("cpu") if device is None else device
        n = args.capacity

        def comm_factory(cfg: ModelConfig) -> ExpertComm:
            if not args.needs_group(world_size):
                return LocalComm(cfg.num_experts, n)
            return BufferComm(
                group,
                cfg.num_experts,
                n,
                cfg.hidden_size,
                backend=args.backend,
                timeout=args.comm_timeout_s,
                fused=args.moe_impl == "fused",
                expert_map=build_expert_map(args, cfg, world_size),
                num_moe_layers=len(cfg.moe_layers),
            )

        rss_before = _rss_bytes()
        self.model = load_model(args.model, comm_factory, args.dtype, args.seed, args.random_model, self.device)
        if args.int8_experts:
            for moe in self.model.moe_layers():
                moe.experts.quantize_int8()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        dtype, cfg = DTYPES[args.dtype], self.model.cfg
        block_bytes = bytes_per_block(cfg, args.block_size, dtype)
        cap = args.max_num_seqs * -(-args.max_model_len // args.block_size) * block_bytes
        budget, source = kv_budget_bytes(
            self.device,
            args.kv_cache_memory,
            args.gpu_memory_utilization,
            args.local_workers,
            cap,
            self._activation_peak,
        )
        num_blocks = budget // block_bytes
        self.model.comm.take_load()  # (the activation probe's forward is no load)
        # a pool under one full-length request is refused by the driver, which then stops this worker
        self.cache = PagedKVCache(cfg, max(num_blocks, 1), args.block_size, dtype, self.device)
        experts = [t for moe in self.model.moe_layers() for t in moe.expert_tensors()]
        self.info = WorkerInfo(
            rank=rank,
            rss_before_load=rss_before,
            peak_rss_after_load=peak,
            expert_bytes=sum(t.numel() * t.element_size() for t in experts),
            weight_bytes=sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
            + sum(t.numel() * t.element_size() for moe in self.model.moe_layers() for t in moe._mega_weights or ()),
            kv_cache_bytes=self.cache.num_bytes(),
            num_kv_blocks=num_blocks,
            kv_bytes_per_block=block_bytes,
            kv_budget_source=source,
            num_local_experts=self.model.comm.num_local_experts,
            device=str(self.device),
            # the Buffer backend the MoE layers run on ("local": EP 1 without a Buffer, in-process dispatch)
            moe_backend=self.model.comm.buffer.backend_name if isinstance(self.model.comm, BufferComm) else "local",
        )
        self.rebalancer: Rebalancer | None = None
        if args.eplb and isinstance(self.model.comm, BufferComm):
            moe_layers = self.model.moe_layers()
            self.rebalancer = Rebalancer(self.model.comm, moe_layers, args.eplb_interval, args.eplb_window)
        comm = self.model.comm  # two micro-batches (two_batch.py): on an EP group's Buffer, not the fused path
        self._two_batch = args.two_batch_overlap and isinstance(comm, BufferComm) and not comm.fused
        self._fallback = torch.Generator(self.device).manual_seed(args.seed * 7919 + rank)
        threads = args.threads_per_worker()  # a step's torch threads: (<= THREADED_STEP_TOKENS tokens, more)
        self._step_threads = (1 if self.device.type == "cpu" and not args.worker_threads else threads, threads)
        expert_mm.set_num_threads(threads)  # the weights' reads take every thread, whatever torch's
        self._seqs: dict[int, _Seq] = {}
        self._step: _Step | None = None
        self.transfer: TransferBackend | None = None
        if args.disaggregation_mode != "none":  # the cache is registered: prefill: read by decode workers
            self.transfer = make_backend(args.transfer_backend, args.kv_transfer_host)
            tensors = cache_tensors(self.cache.layers)
            self.transfer.register(tensors)
            self.info = dataclasses.replace(
                self.info,
                kv_segment=self.transfer.segment,
                kv_bases=[t.data_ptr() for t in tensors],
                kv_block_bytes=[t[0].numel() * t.element_size() for t in tensors],
            )
        cfg = self.model.cfg
        self._grammars = WorkerGrammars(lambda: load_tokenizer(args.model, cfg.eos_token_ids), cfg.vocab_size)

    def _sampler(self, params: SamplingParams) -> RequestSampler:
        """A new request's sampling state (with its grammar's matcher when it is constrained)."""
        grammar = None if params.grammar is None else self._grammars.start(params.grammar)
        return RequestSampler(params, self._fallback, self.model.cfg.vocab_size, grammar)

    def _activation_peak(self) -> int:
        """Bytes the device's allocator peaks at during a forward of the full capacity N (accelerators only; every
        rank runs it at start-up, so the MoE collectives match)."""
        n, bs = self.args.capacity, self.args.block_size
        scratch = PagedKVCache(self.model.cfg, -(-n // bs), bs, DTYPES[self.args.dtype], self.device)
        batch = ForwardBatch.build(
            [SeqInput(range(scratch.num_blocks), 0, [0] * n)], bs, self.device, n * self.world_size
        )
        torch.accelerator.reset_peak_memory_stats(self.device)
        before = torch.accelerator.memory_allocated(self.device)
        self.model(batch, scratch)
        return torch.accelerator.max_memory_allocated(self.device) - before

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: its sequences' bookkeeping, the forward, the sampling (raises :class:`StepAborted` when a
        rank failure interrupts the forward). A new plan confirms the EPLB rebalance staged at the last step."""
        if self.rebalancer is not None:
            self.rebalancer.commit()
        for seq_id in plan.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        pulled: dict[int, KVPull] = {}
        pull_results: list[PullResult] = []
        if plan.pulls:
            assert self.transfer is not None, "a KV pull needs --disaggregation-mode decode"
            tensors = cache_tensors(self.cache.layers)
            pulled = {p.seq_id: p for p in plan.pulls}
            pull_results = [run_pull(self.transfer, tensors, self.cache.block_size, p) for p in plan.pulls]
        seqs, inputs = [], []
        for e in plan.entries:
            if e.params is not None:
                self._seqs[e.seq_id] = _Seq(self._sampler(e.params))
                if e.seq_id in pulled:  # its prompt was computed by a prefill instance, its first token sampled there
                    self._seqs[e.seq_id].sampler.resume(pulled[e.seq_id].prompt_ids, pulled[e.seq_id].first_token)
            seq = self._seqs.get(e.seq_id)
            if seq is None:
                raise ValueError(f"the plan names sequence {e.seq_id}, which this worker does not hold")
            if e.reset_blocks:
                seq.block_table = list(e.new_block_ids)
            else:
                seq.block_table += e.new_block_ids
            tokens = [seq.last_token] if e.token_ids is None else e.token_ids
            seqs.append(seq)
            inputs.append(SeqInput(seq.block_table, e.start, tokens, e.sample, seq.sampler.wants_all_logits))
        batch = ForwardBatch.build(inputs, self.cache.block_size, self.device, plan.num_tokens_all_ranks)
        if self._two_batch and plan.num_tokens_all_ranks is not None:
            batch.micro = micro_batches(inputs, self.cache.block_size, self.device, plan.num_tokens_all_ranks)
        self._step = _Step(seqs, inputs, batch, pull_results)
        return self._run(rebalance=True)

    def regroup(self, members: list[int], rerun: bool) -> StepResult | None:
        """The driver's word after a failure (elastic mode), at a step boundary on every member: the MoE layers
        continue on ``members`` (EP ranks; a staged EPLB rebalance is dropped) and, with ``rerun``, the last step
        runs again on them. A step that finished here before keeps its sampled tokens (computed with every rank
        that took part then; the re-run rewrites the same KV entries), one that did not is sampled now."""
        if self.rebalancer is not None:
            self.rebalancer.discard()
        assert isinstance(self.model.comm, BufferComm), "only an EP group regroups"
        try:
            self.model.comm.regroup(members)
        except RuntimeError as e:  # a member lost meanwhile (the group's rendezvous fails): the driver tries again
            raise StepAborted(f"worker {self.rank}: regrouping on {members} failed: {e}") from e
        return self._run(rebalance=False) if rerun else None

    def _run(self, rebalance: bool) -> StepResult:
        """The forward of :attr:`_step` and, the first time it completes, its sampling; raises :class:`StepAborted`
        when a rank failure interrupts it. ``rebalance``: an EPLB rebalance due now may run (not on a re-run: the
        ranks that finished before do not take part in it)."""
        t0, step, comm = time.perf_counter(), self._step, self.model.comm
        assert step is not None, "no step to run"
        comm.stats.reset()
        comm.take_load()  # (an interrupted attempt's partial counts)
        torch.set_num_threads(self._step_threads[step.batch.num_tokens > THREADED_STEP_TOKENS])
        try:
            logits = self.model(step.batch, self.cache)
        except EPRankFailure as e:
            raise StepAborted(f"worker {self.rank}: {e}") from e
        if step.result is not None:
            return step.result
        result = self._sample(step.seqs, step.inputs, logits)
        result.pulls = step.pulls
        result.forward_time, result.dispatch_time, result.combine_time = (
            time.perf_counter() - t0,
            comm.stats.dispatch,
            comm.stats.combine,
        )
        load = comm.take_load()  # rows each local expert slot received this step, per MoE layer
        result.expert_load = [] if load is None else load.sum(dim=1).tolist()
        result.num_lost_experts = sum(len(lost) for lost in comm.lost_experts)
        if self.rebalancer is not None:  # at this step boundary, on every worker
            result.regroup = self.rebalancer.after_step(load, rebalance)
        step.result = result
        return result

    def _sample(self, seqs: list[_Seq], inputs: list[SeqInput], logits: torch.Tensor) -> StepResult:
        """Each sampling sequence's next token from ``logits`` `[num_rows, vocab]` `torch.float32` (rows as
        :meth:`ForwardBatch.build` orders them): the plain greedy ones in one batched argmax (constrained ones under
        their grammars' masks), the others one by one with their own parameters and generators."""
        result = StepResult([], 0.0, 0.0, 0.0)
        finite = torch.isfinite(logits).all(dim=-1)  # a NaN / Inf row ends its request (NONFINITE_TOKEN), not token 0
        greedy: list[tuple[int, _Seq]] = []  # (logits row, sequence)
        greedy_at: list[int] = []  # their places in the result
        row = 0
        for seq, inp in zip(seqs, inputs, strict=True):
            num_rows = len(inp.token_ids) if inp.all_logits else int(inp.sample)
            seq.sampler.feed(list(inp.token_ids), logits[row : row + num_rows] if inp.all_logits else None)
            row += num_rows
            if not inp.sample:
                continue
            if seq.sampler.plain_greedy:
                greedy.append((row - 1, seq))
                greedy_at.append(len(result.token_ids))
                token, logprob, prompt_logprobs = -1, None, None
            elif not bool(finite[row - 1]):  # (a host read, as sample() makes anyway)
                seq.sampler.mark_sampled()
                token, logprob, prompt_logprobs = NONFINITE_TOKEN, None, None
                seq.last_token = 0  # any id: the driver ends the request
            else:
                token, logprob, prompt_logprobs = seq.sampler.sample(logits[row - 1])
                seq.last_token = token
            result.token_ids.append(token)
            result.logprobs.append(logprob)
            result.prompt_logprobs.append(prompt_logprobs)
        if greedy:
            rows = torch.tensor([r for r, _ in greedy], dtype=torch.int64, device=logits.device)
            candidates = logits[rows]  # (a copy) constrained rows masked by their grammars
            mask_rows(candidates, [seq.sampler.grammar for _, seq in greedy], self.model.cfg.vocab_size)
            picked = torch.where(finite[rows], candidates.argmax(dim=-1), NONFINITE_TOKEN).tolist()
            for at, (_, seq), token in zip(greedy_at, greedy, picked, strict=True):
                seq.sampler.mark_sampled(token if token >= 0 else None)
                result.token_ids[at] = token
                seq.last_token = max(token, 0)  # a non-finite row's request is ended by the driver
        return result

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        destroy = getattr(self.model.comm, "destroy", None)
        if destroy is not None:
            destroy()
