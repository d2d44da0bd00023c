"""The backend interface behind :class:`deep_ep_npu.Buffer`: one small ABC; every backend is ``cls(group, config)``.

A backend turns validated DeepEP calls (:mod:`deep_ep_npu.ll_params`) into a *send phase*, run inside the call,
and a *receive phase* returned as a :class:`~deep_ep_npu.event.Completion`; the Buffer runs the receive at once,
at ``event.current_stream_wait()`` (``async_finish``) or in ``hook()`` (``return_recv_hook``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

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


class DispatchResult(NamedTuple):
    """``recv_x`` (a tensor, or ``(data, scales)``), ``recv_count`` `[L]` int32, the handle, and the receive phase.
    The tensors are allocated by the send phase and filled by ``completion``."""

    recv_x: Any
    recv_count: torch.Tensor
    handle: LowLatencyHandle
    completion: Completion


class CombineResult(NamedTuple):
    """``combined_x`` `[T, hidden]` (filled by ``completion``) and the receive phase."""

    combined_x: torch.Tensor
    completion: Completion


class LowLatencyBackend(abc.ABC):
    """Moves tokens for the Buffer. Subclasses set ``name`` and ``native_quant_format`` (``use_fp8=True``'s format)."""

    name: str = ""
    native_quant_format: str = "fp8_e4m3"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        self.group = group
        self.config = config
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32)  # shrink mode: 1 = rank treated as absent
        # bounded collectives over the live ranks; in shrink mode, continues on the survivors (deep_ep_npu.ep_group)
        self.ep = EPGroup(group, self.mask, config.timeout, config.enable_shrink)

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Run the send phase of a validated low-latency dispatch."""

    @abc.abstractmethod
    def combine(self, args: CombineArgs) -> CombineResult:
        """Run the send phase of a validated low-latency combine."""

    def abort(self, op: str, code: int) -> None:  # noqa: B027 - optional hook, default: nothing to tell the peers
        """Tell the peers that this rank rejected its input of ``op`` ("dispatch"/"combine") so they raise too."""

    @abc.abstractmethod
    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[L, R * N, hidden]` bfloat16 buffer the next ``zero_copy`` combine reads."""

    @abc.abstractmethod
    def dispatch_flat(self, params: DispatchParams) -> Completion:
        """Start ``npu_moe_distribute_dispatch_v2`` (its ``wait()`` returns the 7 outputs)."""

    @abc.abstractmethod
    def combine_flat(self, params: CombineParams) -> Completion:
        """Start ``npu_moe_distribute_combine_v2`` (its ``wait()`` returns ``x``)."""

    def clean(self) -> None:  # noqa: B027 - optional hook
        """Reset communication state between two barriers (``clean_low_latency_buffer``)."""

    def destroy(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and communication contexts."""


def map_no_expert(topk_idx: torch.Tensor, num_experts: int, zero_expert_num: int = 0) -> tuple[torch.Tensor, int]:
    """Map DeepEP's ``-1`` ("no expert") onto Ascend zero experts, which are never sent and add nothing in combine.

    Slot k's ``-1`` becomes zero expert ``num_experts + zero_expert_num + k`` (distinct within a row); ids of the
    caller's copy/const experts (``>= num_experts + zero_expert_num``) shift up by K to make room.

    Arguments:
        topk_idx: `[T, K]` `torch.int64` / `torch.int32`, values in ``[-1, ...)``.

    Returns:
        expert_ids: `[T, K]` `torch.int32` ids for the Ascend ops, and the zero_expert_num to give them
        (``zero_expert_num + K``).
    """
    k = topk_idx.shape[1]
    first_extra = num_experts + zero_expert_num
    ids = topk_idx.to(torch.int32)
    ids = torch.where(ids >= first_extra, ids + k, ids)
    slot = torch.arange(k, dtype=torch.int32, device=ids.device).expand_as(ids)
    ids = torch.where(ids < 0, first_extra + slot, ids)
    return ids, zero_expert_num + k
