"""``EngineConfig``: the one description of an EP engine that the driver, spawned workers, torchrun ranks and the
offline ``LLM`` all take. It is validated once, when it is made; :meth:`EngineConfig.from_server_config` builds it
from the server's ``ServerConfig``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from server.config import parse_bytes
from server.loader import DTYPES

DEFAULT_STEP_TIMEOUT_S = 30.0
MOE_IMPLS = ("unfused", "fused")
LAUNCHES = ("auto", "spawn", "torchrun")
DISAGGREGATION_MODES = ("none", "prefill", "decode")


def default_capacity(max_num_seqs: int, max_num_batched_tokens: int | None = None) -> int:
    """The per-step token capacity N of a worker: the given value, else ``max(max_num_seqs, 64)``."""
    return max_num_batched_tokens or max(max_num_seqs, 64)


def torchrun_env() -> bool:
    """True when launched by ``torchrun`` (RANK, WORLD_SIZE and MASTER_ADDR are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs and how every worker builds its shard (the same on all ranks).

    ``model`` an HF checkpoint dir or None for the random model ``random_model`` (spec for
    :func:`server.loader.random_hf_config`) from ``seed``; ``ep_size`` workers; ``dtype`` float32/bfloat16/float16;
    ``backend`` the ``deep_ep_npu.Buffer`` backend; ``device`` / ``dist_backend`` / ``simulate_npu`` where the workers
    run (:mod:`server.runtime.workers.placement`); ``max_num_seqs`` (per worker) and ``max_model_len``;
    ``max_num_batched_tokens`` the per-step token capacity N of each worker, also the MoE Buffers'
    ``num_max_dispatch_tokens_per_rank`` (None: ``max(max_num_seqs, 64)``, filled in here; longer prefills are
    chunked); the paged KV cache: ``block_size`` tokens per block, ``kv_cache_memory`` bytes per worker (an int,
    or ``"4G"``: :func:`server.config.parse_bytes`) or else ``gpu_memory_utilization``
    (:mod:`server.runtime.scheduling.kv_budget`), ``enable_prefix_caching``;
    ``async_scheduling`` plan step k+1 while the workers run step k (spawned workers); ``two_batch_overlap`` (EP > 1)
    steps of at least 16 tokens over all workers as two micro-batches (:mod:`server.models.two_batch`);
    ``worker_threads`` torch
    threads per worker (None: the CPUs this process may use, split over the local workers, and one for a CPU
    worker's steps of few tokens: :data:`server.runtime.workers.worker.THREADED_STEP_TOKENS`); ``int8_experts`` W8A8
    routed experts; ``moe_impl``
    ``unfused`` (dispatch -> experts -> combine) or ``fused`` (``Buffer.mega_moe``); ``launch`` ``spawn``,
    ``torchrun`` (this process is a rank of a torchrun job) or ``auto``; ``dist_timeout_s`` the process groups'
    timeout; ``step_timeout_s`` how long one lockstep step (or a health ping) may take; ``elastic`` keep serving on
    the survivors of a lost worker (spawned workers or torchrun ranks); ``use_buffer_at_ep1`` EP 1 through a Buffer
    instead of the in-process dispatch; expert load balancing (``docs/eplb.md``):
    ``num_redundant_experts`` extra expert slots, ``expert_placement`` a static placement file (vllm-ascend's JSON),
    ``eplb`` rebalance every ``eplb_interval`` steps from the load of the last ``eplb_window`` steps;
    ``socket_ifname`` the network interface(s) of a torchrun rank's process groups (``GLOO_SOCKET_IFNAME`` /
    ``HCCL_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; None: as the environment says);
    prefill/decode disaggregation (:mod:`server.disagg`): ``disaggregation_mode`` ``none`` / ``prefill`` /
    ``decode``, ``transfer_backend`` (``mooncake``), ``bootstrap_port`` (a prefill instance's bootstrap server; 0:
    any free port), ``disaggregation_timeout_s`` (how long parked KV waits for its decode instance, and a decode
    instance for its prefill) and ``kv_transfer_host`` (the address the workers' transfer engines bind).
    """

    model: str | None = None
    ep_size: int = 1
    dtype: str = "float32"
    backend: str = "auto"
    device: str = "cpu"
    dist_backend: str = "gloo"
    simulate_npu: bool = False
    max_num_seqs: int = 16
    max_model_len: int = 512
    seed: int = 0
    random_model: dict | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    two_batch_overlap: bool = False
    worker_threads: int | None = None
    int8_experts: bool = False
    moe_impl: str = "unfused"
    launch: str = "auto"
    dist_timeout_s: float = 120.0
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    elastic: bool = False
    use_buffer_at_ep1: bool = False
    num_redundant_experts: int = 0
    expert_placement: str | None = None
    eplb: bool = False
    eplb_interval: int = 1000
    eplb_window: int = 1000
    socket_ifname: str | None = None
    disaggregation_mode: str = "none"
    transfer_backend: str = "mooncake"
    bootstrap_port: int = 8998
    disaggregation_timeout_s: float = 60.0
    kv_transfer_host: str = "127.0.0.1"
    model_name: str = "random-qwen3-moe"

    def __post_init__(self) -> None:
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(
                f"moe_impl={self.moe_impl!r} must be 'unfused' (dispatch/experts/combine) or 'fused' (mega_moe)"
            )
        if self.moe_impl == "fused" and self.int8_experts:
            raise ValueError("moe_impl='fused' uses the float expert weights; it cannot be combined with int8_experts")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if self.launch not in LAUNCHES:
            raise ValueError(f"launch={self.launch!r} must be 'auto', 'spawn' or 'torchrun'")
        for name in ("ep_size", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        for name in ("kv_cache_memory", "worker_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be None or an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s!r} must be > 0 (seconds)")
        n = default_capacity(self.max_num_seqs, self.max_num_batched_tokens)
        if n < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={n} must be >= max_num_seqs={self.max_num_seqs}")
        object.__setattr__(self, "max_num_batched_tokens", n)
        self._check_balancing()
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode={self.disaggregation_mode!r} must be one of {list(DISAGGREGATION_MODES)}"
            )
        if not self.disaggregation_timeout_s > 0:
            raise ValueError(f"disaggregation_timeout_s={self.disaggregation_timeout_s!r} must be > 0 (seconds)")

    def _check_balancing(self) -> None:
        for name in ("eplb_interval", "eplb_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        r = self.num_redundant_experts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"num_redundant_experts={r!r} must be an integer >= 0")
        balancing = bool(r or self.expert_placement or self.eplb)
        if balancing and not self.needs_group(self.ep_size):
            raise ValueError("num_redundant_experts / expert_placement / eplb need expert parallelism (ep_size > 1)")
        if balancing and (self.moe_impl == "fused" or self.int8_experts):
            raise ValueError(
                "num_redundant_experts / expert_placement / eplb run the unfused float experts; "
                "drop moe_impl='fused' / int8_experts"
            )
        if self.expert_placement is not None:
            from deep_ep_npu.eplb import read_placement_json

            read_placement_json(self.expert_placement, self.ep_size)  # a bad file stops start-up here

    @property
    def capacity(self) -> int:
        """The per-step token capacity N of each worker."""
        assert self.max_num_batched_tokens is not None  # filled in by __post_init__
        return self.max_num_batched_tokens

    @property
    def local_workers(self) -> int:
        """Workers on this machine: ``ep_size`` when spawned, torchrun's ``LOCAL_WORLD_SIZE`` under torchrun."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.use_torchrun else self.ep_size

    def threads_per_worker(self) -> int:
        """``worker_threads``, else this process's CPUs split over the local workers (at least 1)."""
        return self.worker_threads or max(1, len(os.sched_getaffinity(0)) // self.local_workers)

    @property
    def use_torchrun(self) -> bool:
        """This process is a rank of a torchrun job (``launch='torchrun'``, or ``auto`` under torchrun)."""
        return self.launch == "torchrun" or (self.launch == "auto" and torchrun_env())

    @property
    def comm_timeout_s(self) -> float | None:
        """The Buffers' bound on each collective wait: ``step_timeout_s / 3`` when elastic or under torchrun (rank 0
        bounds each step by ``step_timeout_s``), else the library's."""
        return self.step_timeout_s / 3 if self.elastic or self.use_torchrun else None

    def needs_group(self, world_size: int) -> bool:
        """Whether a worker of a ``world_size`` group joins a process group (EP 1 unfused runs without one)."""
        return world_size > 1 or self.use_buffer_at_ep1 or self.moe_impl == "fused"

    def check_placement(self) -> None:
        """Refuse a device / backend combination that cannot run on this machine (before any worker starts)."""
        from server.runtime.workers.placement import check_placement

        check_placement(self.device, self.dist_backend, self.backend, self.simulate_npu, self.local_workers)

    @classmethod
    def from_server_config(cls, config: Any, **overrides: Any) -> EngineConfig:
        """The engine a validated ``ServerConfig`` describes (``overrides``: other fields, e.g. ``launch``). With
        ``simulate-npu`` the NPU's ``device`` / ``dist-backend`` (npu / hccl) run as cpu / gloo on the stand-in."""
        sim = config.simulate_npu
        values = dict(
            model=config.model,
            ep_size=config.ep_size,
            dtype=config.dtype,
            backend=config.backend,
            device="cpu" if sim else config.device,
            dist_backend="gloo" if sim else config.dist_backend,
            simulate_npu=sim,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            seed=config.seed,
            random_model=dict(config.random_model) or None,
            step_timeout_s=config.step_timeout_s,
            elastic=config.elastic,
            moe_impl=config.moe_impl,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enable_prefix_caching=config.enable_prefix_caching,
            async_scheduling=config.async_scheduling,
            two_batch_overlap=config.two_batch_overlap,
            worker_threads=config.worker_threads,
            int8_experts=config.int8_experts,
            num_redundant_experts=config.num_redundant_experts,
            expert_placement=config.expert_placement,
            eplb=config.eplb,
            eplb_interval=config.eplb_interval,
            eplb_window=config.eplb_window,
            socket_ifname=config.socket_ifname,
            disaggregation_mode=config.disaggregation_mode,
            transfer_backend=config.disaggregation_transfer_backend,
            bootstrap_port=config.disaggregation_bootstrap_port,
            disaggregation_timeout_s=config.disaggregation_timeout_s,
            kv_transfer_host=config.transfer_host,
            model_name=config.model_name,
        )
        return cls(**{**values, **overrides})
