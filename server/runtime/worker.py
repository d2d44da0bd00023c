"""One EP decode worker: its model shard (all shared weights + its own experts), KV cache and sampler state.

A worker owns the requests the driver placed on it (DP attention). Every step it receives a :class:`StepPlan`
(possibly empty: it still enters every MoE dispatch/combine with zero tokens), runs one forward, samples and
returns the new token ids. Every worker, spawned or a torchrun rank, runs the same loop, :func:`serve_plans`, over
a :class:`Channel` to the driver: :class:`PipeChannel` (a private ``multiprocessing`` pipe; :func:`worker_main` is
the process entry of a spawned worker) or :class:`GroupChannel` (a torchrun job's gloo control group).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import resource
import time
import traceback
from typing import Any

import torch

from ..checkpoint import CheckpointError
from ..engine_api import NONFINITE_TOKEN, SamplingParams, TokenLogprob
from ..loader import DTYPES, load_model
from ..models import ForwardBatch, KVCache, LocalComm, ModelConfig
from ..models.ep_comm import BufferComm, ExpertComm
from .engine_config import EngineConfig
from .placement import bind_device
from .rendezvous import init_loopback_group
from .request_sampler import RequestSampler


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
    """Sampled ids in the order of the plan's sampling entries, and this rank's timings (seconds). Per sampled id:
    its log-probabilities (None unless asked for) and, on a request's first sample, its prompt's (None unless asked
    for)."""

    token_ids: list[int]
    forward_time: float
    dispatch_time: float
    combine_time: float
    logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob | None] | None] = dataclasses.field(default_factory=list)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Worker:
    """The model shard of EP rank ``rank`` of ``world_size`` and its per-slot sampling state."""

    def __init__(self, args: EngineConfig, rank: int, world_size: int, group: Any = None, device: Any = None) -> None:
        """``device``: the ``torch.device`` this worker bound (:func:`~server.runtime.placement.bind_device`);
        None: the CPU."""
        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = torch.device("cpu") if device is None else device
        n = args.capacity

        def comm_factory(cfg: ModelConfig) -> ExpertComm:
            if not args.needs_group(world_size):
                return LocalComm(cfg.num_experts, n)
            return BufferComm(group, cfg.num_experts, n, cfg.hidden_size, backend=args.backend,
                              enable_shrink=args.elastic, timeout=args.comm_timeout_s,
                              fused=args.moe_impl == "fused")  # fmt: skip

        rss_before = _rss_bytes()
        self.model = load_model(args.model, comm_factory, args.dtype, args.seed, args.random_model, self.device)
        if args.int8_experts:
            for moe in self.model.moe_layers():
                moe.experts.quantize_int8()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.cache = KVCache(self.model, args.max_num_seqs, args.max_model_len, DTYPES[args.dtype], self.device)
        experts = [t for moe in self.model.moe_layers() for t in moe.expert_tensors()]
        self.info = {
            "rank": rank,
            "rss_before_load": rss_before,
            "peak_rss_after_load": peak,
            "expert_bytes": sum(t.numel() * t.element_size() for t in experts),
            "weight_bytes": sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
            + sum(t.numel() * t.element_size() for moe in self.model.moe_layers() for t in moe._mega_weights or ()),
            "kv_cache_bytes": self.cache.num_bytes(),
            "num_local_experts": self.model.comm.num_local_experts,
            "device": str(self.device),
            # the Buffer backend the MoE layers run on ("local": EP 1 without a Buffer, in-process dispatch)
            "moe_backend": self.model.comm.buffer.backend_name if isinstance(self.model.comm, BufferComm) else "local",
        }
        self._fallback = torch.Generator(self.device).manual_seed(args.seed * 7919 + rank)
        self._slots: dict[int, RequestSampler] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.model.comm.stats.reset()
        for e in plan.entries:
            if e.params is not None:
                self._slots[e.slot] = RequestSampler(e.params, self._fallback, self.model.cfg.vocab_size)
        samplers = [self._slots[e.slot] for e in plan.entries]
        all_logits = [s.wants_all_logits for s in samplers]
        batch = ForwardBatch.build([(e.slot, e.start, e.token_ids) for e in plan.entries],
                                   [e.sample for e in plan.entries], self.device, all_logits)  # fmt: skip
        logits = self.model(batch, self.cache)
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # a NaN / Inf row ends its request, not token 0
        result = StepResult([], 0.0, 0.0, 0.0)
        row = 0
        for e, sampler, want_all in zip(plan.entries, samplers, all_logits, strict=True):
            num_rows = len(e.token_ids) if want_all else int(e.sample)
            sampler.feed(e.token_ids, logits[row : row + num_rows] if want_all else None)
            row += num_rows
            if e.sample and not finite[row - 1]:
                result.token_ids.append(NONFINITE_TOKEN)
                result.logprobs.append(None)
                result.prompt_logprobs.append(None)
            elif e.sample:
                token, logprob, prompt_logprobs = sampler.sample(logits[row - 1])
                result.token_ids.append(token)
                result.logprobs.append(logprob)
                result.prompt_logprobs.append(prompt_logprobs)
        stats = self.model.comm.stats
        result.forward_time, result.dispatch_time, result.combine_time = (
            time.perf_counter() - t0, stats.dispatch, stats.combine)  # fmt: skip
        return result

    def close(self) -> None:
        destroy = getattr(self.model.comm, "destroy", None)
        if destroy is not None:
            destroy()


class Channel(abc.ABC):
    """A worker's end of its control channel to the driver. Messages are ``(kind, payload)``: from the driver
    ``("step", StepPlan)``, ``("ping", None)``, ``("stop", None)``; to it ``("ready", info)``, ``("ok", StepResult)``,
    ``("pong", None)``, ``("error", traceback text)``."""

    @abc.abstractmethod
    def recv(self) -> tuple[str, Any]:
        """The driver's next message (``("stop", None)`` when the driver is gone)."""

    @abc.abstractmethod
    def send(self, kind: str, payload: Any) -> None: ...


class PipeChannel(Channel):
    """A spawned worker's private ``multiprocessing`` pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def recv(self) -> tuple[str, Any]:
        try:
            kind, payload = self.conn.recv()
        except EOFError:  # the driver is gone
            return "stop", None
        return kind, payload

    def send(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))


class GroupChannel(Channel):
    """A torchrun rank > 0: rank 0 broadcasts every rank's plans over the gloo ``group``; replies are gathered to
    rank 0 (:class:`~server.runtime.workers.TorchrunWorkers` is the other end)."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self.rank = group, rank

    def recv(self) -> tuple[str, Any]:
        import torch.distributed as dist

        msg: list[Any] = [None]
        dist.broadcast_object_list(msg, src=0, group=self.group)
        kind, plans = msg[0]
        return kind, (plans[self.rank] if kind == "step" else None)

    def send(self, kind: str, payload: Any) -> None:
        import torch.distributed as dist

        dist.gather_object((kind, payload), None, dst=0, group=self.group)


class StepFailed(Exception):
    """A step raised; its traceback has been sent to the driver."""


def serve_plans(worker: Worker, channel: Channel) -> None:
    """The worker loop: report ready, then run each plan the driver sends until "stop". A failing step sends
    ``("error", traceback)`` and raises :class:`StepFailed`."""
    channel.send("ready", worker.info)
    while True:
        kind, payload = channel.recv()
        if kind == "stop":
            return
        if kind == "ping":  # the driver's liveness probe
            channel.send("pong", None)
            continue
        try:
            result = worker.execute(payload)
        except Exception as e:
            channel.send("error", f"worker {worker.rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
            raise StepFailed from e
        channel.send("ok", result)


def worker_main(rank: int, world_size: int, port: int, conn: Any, args: EngineConfig) -> None:
    """Process entry of a spawned worker: bind device ``rank`` (install the NPU stand-in with ``simulate_npu``),
    join the EP group (``args.dist_backend``), build the shard, :func:`serve_plans` over the pipe ``conn`` until
    "stop" or until the driver's end closes. Any exception is sent to the driver with its traceback."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    channel = PipeChannel(conn)
    try:
        device = bind_device(args.device, rank, args.simulate_npu)
        if args.needs_group(world_size):
            init_loopback_group(rank, world_size, port, args.dist_timeout_s, args.dist_backend)
        worker = Worker(args, rank, world_size, dist.group.WORLD if dist.is_initialized() else None, device)
        serve_plans(worker, channel)
        worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except StepFailed:  # reported by serve_plans
        os._exit(1)  # peers may be blocked in a collective with us: no group teardown
    except CheckpointError as e:  # a fault of the checkpoint (a NaN weight, ...): its one line, no traceback
        try:
            channel.send("error", f"worker {rank}: {e}")
        finally:
            os._exit(1)
    except BaseException:  # noqa: BLE001 - forwarded to the driver with the traceback, then this process exits
        try:
            channel.send("error", f"worker {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
        finally:
            os._exit(1)  # peers may be blocked in a collective with us: no group teardown
