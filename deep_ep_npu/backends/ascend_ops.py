"""The Ascend ops the ``ascend`` backend calls, behind one interface (:class:`_Ops`): ops-transformer's V3 context ops
(``MoeDistributeBuffer`` of ``cann_ops_transformer.ops`` / ``npu_ops_transformer.ops``, created on first use with the
CCL size) or torch_npu's ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` on the group's HCCL communicator name;
the CCL window checked against what the shapes need; and the fused MegaMoE op with the device its tensors live on."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import envs
from ..errors import shape
from ..sizes import ccl_buffer_bytes, ccl_buffer_mb
from . import hccl_comm_name


def pad_empty(rows: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU ops need Bs >= 1: a rank with no tokens sends one zero row routed nowhere (all ids -1)."""
    if topk_idx.shape[0]:
        return rows, topk_idx
    return rows.new_zeros((1, rows.shape[1])), topk_idx.new_full((1, topk_idx.shape[1]), -1)


def map_no_expert(topk_idx: torch.Tensor, num_experts: int, zero_expert_num: int = 0) -> tuple[torch.Tensor, int]:
    """Map DeepEP's ``-1`` ("no expert") in `[T, K]` int64 / int32 ``topk_idx`` onto Ascend zero experts (never sent,
    add nothing in combine): slot k's ``-1`` becomes zero expert ``num_experts + zero_expert_num + k`` (distinct in a
    row); the caller's copy/const expert ids (``>= num_experts + zero_expert_num``) shift up by K to make room.
    Returns the `[T, K]` int32 ids for the ops and their zero_expert_num (``zero_expert_num + K``)."""
    k, first_extra = topk_idx.shape[1], num_experts + zero_expert_num
    ids = torch.where(topk_idx >= first_extra, topk_idx + k, topk_idx).to(torch.int32)
    slot = torch.arange(k, dtype=torch.int32, device=ids.device).expand_as(ids)
    return torch.where(ids < 0, first_extra + slot, ids), zero_expert_num + k


class _Ops:
    """``dispatch(x, ids, moe_expert_num, num_max, num_local, **op_kwargs)`` -> the 7 outputs of
    ``npu_moe_distribute_dispatch_v2``; ``combine(expand_x, ids, assist, counts, weights, moe_expert_num, **kw)`` ->
    ``x``. ``path`` names the ops; ``fused_op`` / ``device_type`` / ``group_name`` / ``prepare_weight``: the fused
    MegaMoE op (None when absent), the device type its tensors live on, the comm name and the weight format cast."""

    path = "torch_npu"
    fused_op: Callable[..., Any] | None = None
    device_type = "npu"

    def __init__(self, torch_npu: Any, group: dist.ProcessGroup, ccl_buffer_size: int | None) -> None:
        self.torch_npu, self.group, self.ccl_buffer_size = torch_npu, group, ccl_buffer_size
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.created: int | None = None  # the CCL size the V3 context was created with
        self.env = envs.hccl_buffsize_mb()
        self.group_name: Callable[[dist.ProcessGroup, int], str] = hccl_comm_name
        self.prepare_weight: Callable[[torch.Tensor], torch.Tensor] = lambda w: torch_npu.npu_format_cast(w, 29)
        with contextlib.suppress(AttributeError, RuntimeError):
            self.fused_op = torch.ops._C_ascend.dispatch_ffn_combine
        if getattr(torch_npu, "SIMULATED", 0):  # deep_ep_npu.sim: tensors on its device_type
            self.device_type = str(getattr(torch_npu, "device_type", "npu"))

    def ccl_size(self, num_max: int, hidden: int, num_local: int, topk: int) -> int:
        """The CCL window (MB) for these shapes; raises, naming the size needed, if the one in use is smaller."""
        need = ccl_buffer_mb(ccl_buffer_bytes(self.num_ranks, num_max, hidden, num_local, topk))
        first = "ccl_buffer_size (the context was created on the first call with this size)"
        env = self.env if self.path == "torch_npu" else None
        for have, source in ((self.ccl_buffer_size, "ccl_buffer_size"), (self.created, first), (env, "HCCL_BUFFSIZE")):
            if have is not None and have < need:
                shapes = f"R={self.num_ranks}, N={num_max}, hidden={hidden}, L={num_local}, K={topk}"
                fix = f"at least {need} MB is needed (Buffer.get_low_latency_ccl_buffer_size)"
                raise shape("ccl_buffer_size", f"{source}: {have} MB is too small for {shapes}: {fix}")
        return self.ccl_buffer_size if self.ccl_buffer_size is not None else max(need, self.created or 0)

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, moe_expert_num: int, num_max: int, num_local: int, **kw: Any
    ) -> tuple[torch.Tensor, ...]:
        self.ccl_size(num_max, x.shape[1], num_local, ids.shape[1])
        op = self.torch_npu.npu_moe_distribute_dispatch_v2
        return tuple(op(x, ids, self.comm_name, self.num_ranks, self.rank, moe_expert_num, **kw))

    def combine(
        self,
        expand_x: torch.Tensor,
        ids: torch.Tensor,
        assist: torch.Tensor,
        counts: torch.Tensor,
        weights: torch.Tensor,
        moe_expert_num: int,
        **kw: Any,
    ) -> torch.Tensor:
        args = (expand_x, ids, assist, counts, weights, self.comm_name, self.num_ranks, self.rank, moe_expert_num)
        return self.torch_npu.npu_moe_distribute_combine_v2(*args, **kw)

    @functools.cached_property
    def comm_name(self) -> str:
        """The group's HCCL communicator name (asked once)."""
        return self.group_name(self.group, self.rank)


class _ContextOps(_Ops):
    """ops-transformer's ``MoeDistributeBuffer`` (the V3 context ops), created on first use with the CCL size."""

    def __init__(self, module: Any, torch_npu: Any, group: dist.ProcessGroup, ccl_buffer_size: int | None) -> None:
        super().__init__(torch_npu, group, ccl_buffer_size)
        self.module, self.path, self.buffer = module, module.__name__.split(".")[0], None

    def _method(self, name: str, ccl_buffer_size: int) -> Any:
        if self.buffer is None:
            self.buffer = self.module.MoeDistributeBuffer(self.group, ccl_buffer_size)
            self.created = ccl_buffer_size
        return getattr(self.buffer, name, None) or getattr(self.buffer, "npu_" + name)

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, moe_expert_num: int, num_max: int, num_local: int, **kw: Any
    ) -> tuple[torch.Tensor, ...]:
        ccl = self.ccl_size(num_max, x.shape[1], num_local, ids.shape[1])
        kw["num_max_dispatch_tokens_per_rank"] = kw.pop("global_bs") // self.num_ranks
        kw["x_smooth_scale"], kw["topk_weights"] = kw.pop("scales", None), kw.pop("expert_scales", None)
        kw.pop("performance_info", None)  # not exposed by the context wrapper
        outs = self._method("low_latency_dispatch", ccl)(x, ids, moe_expert_num, **kw)
        # the torch_npu op's outputs, without tp_recv_counts: add a `[1]` int32 zero one
        return (*outs[:5], torch.zeros((1,), dtype=torch.int32, device=outs[0].device), outs[5])

    def combine(
        self,
        expand_x: torch.Tensor,
        ids: torch.Tensor,
        assist: torch.Tensor,
        counts: torch.Tensor,
        weights: torch.Tensor,
        moe_expert_num: int,
        **kw: Any,
    ) -> torch.Tensor:
        kw.update(num_experts=moe_expert_num, num_max_dispatch_tokens_per_rank=kw.pop("global_bs") // self.num_ranks)
        return self._method("low_latency_combine", 0)(expand_x, ids, weights, assist, counts, **kw)


def find_ops(torch_npu: Any, group: dist.ProcessGroup, ccl_buffer_size: int | None) -> _Ops:
    """The V3 context ops when installed (first found wins), else torch_npu's."""
    for name in ("cann_ops_transformer.ops", "npu_ops_transformer.ops"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "MoeDistributeBuffer"):
                return _ContextOps(module, torch_npu, group, ccl_buffer_size)
    return _Ops(torch_npu, group, ccl_buffer_size)
