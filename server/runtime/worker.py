"""One EP decode worker: its model shard (all shared weights + its own experts), KV cache and sampler state.

A worker owns the requests the driver placed on it (DP attention). Every step it receives a :class:`StepPlan`
(possibly empty: it still enters every MoE dispatch/combine with zero tokens), runs one forward, samples and
returns the new token ids. :func:`worker_main` is the process entry for locally spawned workers; the control
channel is a private ``multiprocessing`` pipe.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
import traceback
from typing import Any

import torch

from ..engine_api import SamplingParams
from ..loader import DTYPES, load_model
from ..models import ForwardBatch, KVCache, LocalComm, ModelConfig
from ..models.ep_comm import BufferComm, ExpertComm
from .rendezvous import init_loopback_group
from .sampler import make_generator, sample_one


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """How every worker builds its shard (the same on all ranks)."""

    model: str | None = None
    dtype: str = "float32"
    backend: str = "auto"  # deep_ep_npu Buffer backend
    seed: int = 0
    random_model: dict | None = None
    max_num_seqs: int = 16
    max_model_len: int = 512
    num_max_dispatch_tokens_per_rank: int = 64
    int8_experts: bool = False
    use_buffer_at_ep1: bool = False  # EP 1 uses an in-process dispatch unless this is set
    dist_timeout_s: float = 120.0
    elastic: bool = False  # Buffer shrink mode: survivors of a lost rank regroup and drop its experts
    comm_timeout_s: float | None = None  # the Buffer's bound on each collective wait (None: the library default)
    moe_impl: str = "unfused"  # "fused": Buffer.mega_moe (dispatch -> FFN -> combine in one pipelined call)


@dataclasses.dataclass
class PlanEntry:
    """One request's tokens this step: write KV at ``[start, start + len(token_ids))`` of cache row ``slot``;
    ``sample`` asks for a new token; ``params`` is set on a request's first chunk (it resets the slot's sampler)."""

    slot: int
    start: int
    token_ids: list[int]
    sample: bool
    params: SamplingParams | None = None


@dataclasses.dataclass
class StepPlan:
    entries: list[PlanEntry]


@dataclasses.dataclass
class StepResult:
    """Sampled ids in the order of the plan's sampling entries, and this rank's timings (seconds)."""

    token_ids: list[int]
    forward_time: float
    dispatch_time: float
    combine_time: float


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Worker:
    """The model shard of EP rank ``rank`` of ``world_size`` and its per-slot sampling state."""

    def __init__(self, args: WorkerArgs, rank: int, world_size: int, group: Any = None) -> None:
        self.args, self.rank, self.world_size = args, rank, world_size
        n = args.num_max_dispatch_tokens_per_rank

        def comm_factory(cfg: ModelConfig) -> ExpertComm:
            if world_size == 1 and not args.use_buffer_at_ep1 and args.moe_impl != "fused":
                return LocalComm(cfg.num_experts, n)
            return BufferComm(group, cfg.num_experts, n, cfg.hidden_size, backend=args.backend,
                              enable_shrink=args.elastic, timeout=args.comm_timeout_s,
                              fused=args.moe_impl == "fused")  # fmt: skip

        rss_before = _rss_bytes()
        self.model = load_model(args.model, comm_factory, args.dtype, args.seed, args.random_model)
        if args.int8_experts:
            for moe in self.model.moe_layers():
                moe.experts.quantize_int8()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.cache = KVCache(self.model, args.max_num_seqs, args.max_model_len, DTYPES[args.dtype])
        experts = [t for moe in self.model.moe_layers() for t in moe.experts.state_dict().values()]
        self.info = {
            "rank": rank,
            "rss_before_load": rss_before,
            "peak_rss_after_load": peak,
            "expert_bytes": sum(t.numel() * t.element_size() for t in experts),
            "weight_bytes": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
            "kv_cache_bytes": self.cache.num_bytes(),
            "num_local_experts": self.model.comm.num_local_experts,
        }
        self._fallback = torch.Generator().manual_seed(args.seed * 7919 + rank)
        self._slots: dict[int, tuple[SamplingParams, torch.Generator]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.model.comm.stats.reset()
        for e in plan.entries:
            if e.params is not None:
                self._slots[e.slot] = (e.params, make_generator(e.params, self._fallback))
        batch = ForwardBatch.build(
            [(e.slot, e.start, e.token_ids) for e in plan.entries], [e.sample for e in plan.entries]
        )
        logits = self.model(batch, self.cache)
        sampled = [e for e in plan.entries if e.sample]
        tokens = [sample_one(logits[i], *self._slots[e.slot]) for i, e in enumerate(sampled)]
        stats = self.model.comm.stats
        return StepResult(tokens, time.perf_counter() - t0, stats.dispatch, stats.combine)

    def close(self) -> None:
        destroy = getattr(self.model.comm, "destroy", None)
        if destroy is not None:
            destroy()


def worker_main(rank: int, world_size: int, port: int, conn: Any, args: WorkerArgs) -> None:
    """Process entry of a spawned worker: join the gloo group, build the shard, serve plans until "stop" or until
    the driver's end of ``conn`` closes. Any exception is sent to the driver with its traceback."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    worker = None
    try:
        if world_size > 1 or args.use_buffer_at_ep1 or args.moe_impl == "fused":
            init_loopback_group(rank, world_size, port, args.dist_timeout_s)
        worker = Worker(args, rank, world_size, dist.group.WORLD if dist.is_initialized() else None)
        conn.send(("ready", worker.info))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver is gone
                break
            if msg[0] == "stop":
                break
            if msg[0] == "ping":  # the driver's liveness probe
                conn.send(("pong", None))
                continue
            conn.send(("ok", worker.execute(msg[1])))
        worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the driver with the traceback, then this process exits
        try:
            conn.send(("error", f"worker {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}"))
        finally:
            os._exit(1)  # peers may be blocked in a collective with us: no group teardown
