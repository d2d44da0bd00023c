"""Backends of :class:`deep_ep_npu.Buffer`: ``"reference"`` (torch.distributed), ``"ascend"`` (NPU ops); their ABC.

Backends register the import path of their class (``torch_npu`` is imported only when the Ascend backend is created).
A backend, ``cls(group, config)``, runs the *send phase* of a validated DeepEP call (:mod:`deep_ep_npu.ll_params`) in
``dispatch`` / ``combine`` and returns its *receive phase*, a :class:`~deep_ep_npu.event.Completion` the Buffer runs
at once, at ``event.current_stream_wait()`` (``async_finish``) or in ``hook()`` (``return_recv_hook``);
``dispatch_flat`` / ``combine_flat`` start ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` (``wait()`` returns the
7 outputs / ``x``). Optional hooks: ``abort(op, code)`` (this rank rejected its ``op`` input, "dispatch" / "combine" /
"dispatch_flat" / "combine_flat": the peers raise too), ``clean`` (reset communication state between two barriers),
``destroy`` (release buffers).
"""

import abc
import dataclasses
import importlib
import importlib.util
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..engine.workspace import Workspace
from ..event import Completion
from ..group import EPGroup
from ..handle import LowLatencyHandle
from ..ll_params import CombineArgs, DispatchArgs
from ..params import CombineParams, DispatchParams


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """The Buffer's constructor arguments as a backend sees them (DeepEP names; see ``Buffer`` for which are used)."""

    num_nvl_bytes: int = 0
    num_rdma_bytes: int = 0
    low_latency_mode: bool = False
    num_qps_per_rank: int = 24
    allow_nvlink_for_low_latency_mode: bool = True
    allow_mnnvl: bool = False
    explicitly_destroy: bool = False
    enable_shrink: bool = False
    ccl_buffer_size: int | None = None
    timeout: float | None = None  # seconds per collective wait (deep_ep_npu.failure); None: env / default
    transport: str = "auto"  # the reference backend's: "auto" / "shm" / "collective" (deep_ep_npu.engine.transport)


class DispatchResult(NamedTuple):  # the tensors are allocated by the send phase and filled by ``completion``
    recv_x: Any  # a tensor, or ``(data, scales)``
    recv_count: torch.Tensor  # `[L]` int32
    handle: LowLatencyHandle
    completion: Completion  # the receive phase


class CombineResult(NamedTuple):
    combined_x: torch.Tensor  # `[T, hidden]`, filled by ``completion`` (the receive phase)
    completion: Completion


class LowLatencyBackend(abc.ABC):
    """Moves tokens for the Buffer (see the module docstring). Subclasses set ``name`` and ``native_quant_format``
    (``use_fp8=True``'s format)."""

    name: str = ""
    native_quant_format: str = "fp8_e4m3"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        self.group, self.config = group, config
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32)  # shrink mode: 1 = rank treated as absent
        self.ep = EPGroup(group, self.mask, config.timeout, config.enable_shrink)  # bounded; shrink mode: survivors
        self._ws = Workspace()  # the backend's buffers, grown on demand
        self._buffer_idx = 0  # double-buffered communication buffers: flipped by every dispatch and combine

    def _flip(self) -> int:
        idx, self._buffer_idx = self._buffer_idx, self._buffer_idx ^ 1
        return idx

    def _zero_copy_buffer(self, idx: int, handle: LowLatencyHandle) -> torch.Tensor:
        self._ws.device = handle.src_info.device
        return self._ws.get(f"zero_copy{idx}", (*handle.src_info.shape, handle.hidden), torch.bfloat16)

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[L, R * N, hidden]` bfloat16 buffer the next ``zero_copy`` combine reads."""
        return self._zero_copy_buffer(self._buffer_idx, handle)

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult: ...
    @abc.abstractmethod
    def combine(self, args: CombineArgs) -> CombineResult: ...
    @abc.abstractmethod
    def dispatch_flat(self, params: DispatchParams) -> Completion: ...
    @abc.abstractmethod
    def combine_flat(self, params: CombineParams) -> Completion: ...
    def abort(self, op: str, code: int) -> None: ...  # noqa: B027 - optional hooks: by default, nothing to do
    def clean(self) -> None: ...  # noqa: B027

    def destroy(self) -> None:
        self._ws.clear()


def map_no_expert(topk_idx: torch.Tensor, num_experts: int, zero_expert_num: int = 0) -> tuple[torch.Tensor, int]:
    """Map DeepEP's ``-1`` ("no expert") in `[T, K]` int64 / int32 ``topk_idx`` onto Ascend zero experts (never sent,
    add nothing in combine): slot k's ``-1`` becomes zero expert ``num_experts + zero_expert_num + k`` (distinct in a
    row); the caller's copy/const expert ids (``>= num_experts + zero_expert_num``) shift up by K to make room.
    Returns the `[T, K]` int32 ids for the ops and their zero_expert_num (``zero_expert_num + K``)."""
    k, first_extra = topk_idx.shape[1], num_experts + zero_expert_num
    ids = torch.where(topk_idx >= first_extra, topk_idx + k, topk_idx).to(torch.int32)
    slot = torch.arange(k, dtype=torch.int32, device=ids.device).expand_as(ids)
    return torch.where(ids < 0, first_extra + slot, ids), zero_expert_num + k


_REGISTRY: dict[str, str | type[LowLatencyBackend]] = {
    "reference": f"{__name__}.reference:ReferenceBackend", "ascend": f"{__name__}.ascend:AscendBackend"
}  # fmt: skip


def register_backend(name: str, target: str | type[LowLatencyBackend]) -> None:
    """Register a backend class (or ``"module:Class"`` path) under ``name``; later registrations replace earlier."""
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def hccl_comm_name(group: dist.ProcessGroup, rank: int) -> str:
    """The HCCL communicator name of ``group`` (what the NPU ops' group arguments take), asked of its ``"npu"``
    backend (creating the communicator if needed); with :mod:`deep_ep_npu.sim` installed, ``sim.hccl_comm_name``."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)  # type: ignore[attr-defined]


def npu_available() -> bool:
    """True when torch_npu is installed and reports an NPU (imports torch_npu only if it is installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(hasattr(torch, "npu") and torch.npu.is_available())


def resolve_backend_name(name: str) -> str:
    """``"auto"`` is ``"ascend"`` when torch_npu and an NPU are present, else ``"reference"``."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}; known: {['auto', *available_backends()]}")
    if name == "auto":
        return "ascend" if npu_available() else "reference"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {['auto', *available_backends()]}")
    return name


def create_backend(name: str, group, config: BufferConfig) -> LowLatencyBackend:
    """Build the backend registered as ``name`` (after resolving ``"auto"``)."""
    target = _REGISTRY[resolve_backend_name(name)]
    if isinstance(target, str):
        module_name, _, cls_name = target.partition(":")
        target = getattr(importlib.import_module(module_name), cls_name)
    return target(group, config)


__all__ = ["BufferConfig", "LowLatencyBackend", "available_backends", "create_backend", "map_no_expert",
           "npu_available", "register_backend", "resolve_backend_name"]  # fmt: skip
