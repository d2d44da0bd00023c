"""The Ascend backend: the real MoE distribute ops, converted between DeepEP's masked layout and the flat one.

Ops, first found wins: ops-transformer's context-based V3 ops (``cann_ops_transformer.ops.MoeDistributeBuffer``,
CANN 9.1+, methods ``low_latency_dispatch/combine``; else ``npu_ops_transformer.ops.MoeDistributeBuffer``, methods
``npu_low_latency_dispatch/combine``), else ``torch_npu.npu_moe_distribute_dispatch_v2`` / ``combine_v2`` on the
group's HCCL communicator. ``torch_npu`` is imported when this backend is created, never before.

Mapping (documented in the Buffer): ``-1`` in ``topk_idx`` becomes a zero expert (never sent, adds 0), with
``global_bs = N * R`` so ranks may hold fewer than N tokens (a rank with none sends one row routed nowhere, as
the ops need Bs >= 1); ``use_fp8=True`` is A2/A3's per-token dynamic int8
(``quant_mode=2``); the flat ``expand_x`` (rows expert-major, then source rank, then token) is gathered into
``recv_x`` `[L, R * N, hidden]` with index tensors only (no host synchronization), ``src_info`` is the token of
``assist_info_for_combine``'s (rank, token, slot) triples (the A3 fullmesh layout), and combine gathers the masked
rows back into the flat order. The NPU ops run in stream order at call time: ``hook()`` and the event's wait have
nothing left to do, and ``dispatch_wait_recv_cost_stats`` is the op's ``performance_info`` (µs per source rank).

Limits: validation here is local (no extra collective per call): a rank whose input is rejected raises, but peers
that passed validation enter the NPU op and wait until the HCCL timeout, so give every rank the same N,
num_experts and hidden. ``round_scale`` / ``use_ue8m0`` / fp8 e4m3 have no A2/A3 op. Shrink-mode masks set with
``low_latency_update_mask_buffer`` (the same on every rank) become the ops' ``elastic_info`` (:mod:`.elastic`);
detecting a failed rank on the NPU (HCCL) is not implemented here, so the mask is the caller's.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from .. import envs
from ..errors import invalid, shape
from ..event import Completion
from ..handle import LowLatencyHandle, make_handle
from ..ll_params import CombineArgs, DispatchArgs
from ..params import CombineParams, DispatchParams
from ..sizes import ccl_buffer_bytes, ccl_buffer_mb
from .base import BufferConfig, CombineResult, DispatchResult, LowLatencyBackend, map_no_expert
from .elastic import elastic_info_from_mask, remap_expert_ids

_CONTEXT_PACKAGES = ("cann_ops_transformer.ops", "npu_ops_transformer.ops")


def _exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


def _find_context_ops() -> Any | None:
    for name in _CONTEXT_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "MoeDistributeBuffer"):
            return module
    return None


def _pad_empty(rows: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU ops need Bs >= 1: a rank with no tokens sends one zero row routed nowhere (all ids -1)."""
    if topk_idx.shape[0]:
        return rows, topk_idx
    return rows.new_zeros((1, rows.shape[1])), topk_idx.new_full((1, topk_idx.shape[1]), -1)


class _TorchNpuOps:
    """``torch_npu.npu_moe_distribute_{dispatch,combine}_v2`` on the group's HCCL communicator name."""

    path = "torch_npu"

    def __init__(self, torch_npu: Any, group_name: str, num_ranks: int, rank: int) -> None:
        self.torch_npu, self.group_name, self.num_ranks, self.rank = torch_npu, group_name, num_ranks, rank

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, moe_expert_num: int, **kw: Any) -> tuple:
        return tuple(
            self.torch_npu.npu_moe_distribute_dispatch_v2(
                x, expert_ids, self.group_name, self.num_ranks, self.rank, moe_expert_num, **kw
            )
        )

    def combine(self, expand_x, expert_ids, assist, counts, weights, moe_expert_num: int, **kw: Any) -> torch.Tensor:
        return self.torch_npu.npu_moe_distribute_combine_v2(
            expand_x,
            expert_ids,
            assist,
            counts,
            weights,
            self.group_name,
            self.num_ranks,
            self.rank,
            moe_expert_num,
            **kw,
        )


class _ContextOps:
    """ops-transformer's ``MoeDistributeBuffer`` (the V3 context ops), created on first use with the CCL size."""

    def __init__(self, module: Any, group: dist.ProcessGroup, num_ranks: int) -> None:
        self.module, self.group, self.num_ranks = module, group, num_ranks
        self.path = module.__name__.split(".")[0]
        self.buffer: Any = None
        self.created_ccl_buffer_size: int | None = None

    def _buffer(self, ccl_buffer_size: int) -> Any:
        if self.buffer is None:
            self.buffer = self.module.MoeDistributeBuffer(self.group, ccl_buffer_size)
            self.created_ccl_buffer_size = ccl_buffer_size
        return self.buffer

    def _method(self, name: str, ccl_buffer_size: int) -> Any:
        buf = self._buffer(ccl_buffer_size)
        return getattr(buf, name, None) or getattr(buf, "npu_" + name)

    def dispatch(self, x, expert_ids, moe_expert_num: int, *, ccl_buffer_size: int, **kw: Any) -> tuple:
        global_bs = kw.pop("global_bs")
        kw["x_smooth_scale"] = kw.pop("scales", None)
        kw["topk_weights"] = kw.pop("expert_scales", None)
        kw.pop("performance_info", None)  # not exposed by the context wrapper
        outs = self._method("low_latency_dispatch", ccl_buffer_size)(
            x, expert_ids, moe_expert_num, num_max_dispatch_tokens_per_rank=global_bs // self.num_ranks, **kw
        )
        expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, expand_scales = outs
        tp_recv_counts = torch.zeros((1,), dtype=torch.int32, device=expand_x.device)
        return expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales

    def combine(self, expand_x, expert_ids, assist, counts, weights, moe_expert_num: int, **kw: Any) -> torch.Tensor:
        global_bs = kw.pop("global_bs")
        return self._method("low_latency_combine", 0)(
            expand_x,
            expert_ids,
            weights,
            assist,
            counts,
            num_experts=moe_expert_num,
            num_max_dispatch_tokens_per_rank=global_bs // self.num_ranks,
            **kw,
        )


class AscendBackend(LowLatencyBackend):
    """DeepEP's low-latency API on the Ascend MoE distribute ops (see the module docstring)."""

    name = "ascend"
    native_quant_format = "int8_per_token"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        try:
            torch_npu = importlib.import_module("torch_npu")
        except ImportError as err:
            raise ImportError(
                "backend='ascend' needs torch_npu (pip install 'deep_ep_npu[npu]'); use backend='reference' elsewhere"
            ) from err
        super().__init__(group, config)
        context = _find_context_ops()
        if context is not None:
            self.ops: Any = _ContextOps(context, group, self.num_ranks)
        else:
            self.ops = _TorchNpuOps(torch_npu, self._group_name(), self.num_ranks, self.rank)
        self._buffer_idx = 0
        self._zero_copy: dict[int, torch.Tensor] = {}
        self._env_ccl = envs.hccl_buffsize_mb()

    @property
    def ops_path(self) -> str:
        """Which ops run: ``"cann_ops_transformer"``, ``"npu_ops_transformer"`` or ``"torch_npu"``."""
        return self.ops.path

    def _group_name(self) -> str:
        """The HCCL communicator name the torch_npu ops take as ``group_ep``."""
        device = torch.device("npu")
        return self.group._get_backend(device).get_hccl_comm_name(self.rank)  # type: ignore[attr-defined]

    def _ccl_size(self, num_max: int, hidden: int, num_local: int, topk: int) -> int:
        """The CCL window (MB) for these shapes; raises, naming the size needed, if the one in use is smaller."""
        need = ccl_buffer_mb(ccl_buffer_bytes(self.num_ranks, num_max, hidden, num_local, topk))
        created = getattr(self.ops, "created_ccl_buffer_size", None)
        for have, source in (
            (self.config.ccl_buffer_size, "ccl_buffer_size"),
            (created, "ccl_buffer_size (the context was created on the first call with this size)"),
            (self._env_ccl if isinstance(self.ops, _TorchNpuOps) else None, "HCCL_BUFFSIZE"),
        ):
            if have is not None and have < need:
                raise shape(
                    "ccl_buffer_size",
                    f"{source}: {have} MB is too small for R={self.num_ranks}, N={num_max}, hidden={hidden}, "
                    f"L={num_local}, K={topk}: at least {need} MB is needed (Buffer.get_low_latency_ccl_buffer_size)",
                )
        return self.config.ccl_buffer_size if self.config.ccl_buffer_size is not None else max(need, created or 0)

    def _flip(self) -> int:
        idx, self._buffer_idx = self._buffer_idx, self._buffer_idx ^ 1
        return idx

    def _op_kwargs(self, ccl_size: int) -> dict:
        return {"ccl_buffer_size": ccl_size} if isinstance(self.ops, _ContextOps) else {}

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        if args.quant == "fp8_e4m3":
            raise invalid("quant_format", "fp8_e4m3 has no Ascend A2/A3 op; use_fp8 means int8_per_token here")
        self._flip()
        r, num_local, n, hidden = (
            self.num_ranks,
            args.num_local_experts,
            args.num_max_dispatch_tokens_per_rank,
            args.hidden,
        )
        x, topk_idx = _pad_empty(args.x, args.topk_idx)
        elastic = elastic_info_from_mask(self.mask, num_local)  # shrink mode: masked ranks scaled out
        # moe_expert_num stays E; elastic_info's E' numbers the live experts, zero experts start after them
        op_experts = args.num_experts if elastic is None else int(elastic[3])
        if elastic is not None:
            topk_idx = remap_expert_ids(topk_idx, elastic, num_local)
            elastic = elastic.to(x.device)
        ids, zero_num = map_no_expert(topk_idx, op_experts)
        kw = dict(quant_mode=2 if args.quant else 0, global_bs=n * r, zero_expert_num=zero_num)
        if elastic is not None:
            kw["elastic_info"] = elastic
        if args.dispatch_wait_recv_cost_stats is not None:
            kw["performance_info"] = args.dispatch_wait_recv_cost_stats
        ccl = self._ccl_size(n, hidden, num_local, ids.shape[1])
        expand_x, dynamic_scales, assist, _, ep_recv_counts, _, _ = self.ops.dispatch(
            x, ids, args.num_experts, **kw, **self._op_kwargs(ccl)
        )
        cum = ep_recv_counts[: num_local * r].long()
        counts = (cum - torch.cat([cum.new_zeros(1), cum[:-1]])).view(num_local, r)
        per_expert = counts.sum(dim=1)
        start = _exclusive_cumsum(per_expert)
        # flat row -> its row in the masked layout; rows past the received total go to a spare row at the end, so
        # only the A flat rows are moved (not L * R * N) and nothing needs the counts on the host
        rn, spare = r * n, num_local * r * n
        rows = torch.arange(expand_x.shape[0], device=start.device)
        expert_of_row = torch.searchsorted(per_expert.cumsum(0), rows, right=True)
        expert_clamped = expert_of_row.clamp(max=num_local - 1)
        dest = torch.where(expert_of_row < num_local, expert_clamped * rn + rows - start[expert_clamped], spare)
        recv_x: Any = expand_x.new_empty((spare + 1, hidden)).index_copy_(0, dest, expand_x)[:spare]
        recv_x = recv_x.view(num_local, rn, hidden)
        if args.quant:
            scales = dynamic_scales.new_empty((spare + 1,)).index_copy_(0, dest, dynamic_scales[: rows.numel()])
            recv_x = (recv_x, scales[:spare].view(num_local, rn, 1).expand(-1, -1, hidden // 128))
        tokens = assist.view(-1)[3 * rows + 1].to(torch.int32)
        src_info = tokens.new_empty((spare + 1,)).index_copy_(0, dest, tokens)[:spare].view(num_local, rn)
        layout_range = (_exclusive_cumsum(counts, 1) << 32) | counts
        recv_count = per_expert.to(torch.int32)
        if args.cumulative_local_expert_recv_stats is not None:
            args.cumulative_local_expert_recv_stats += recv_count
        scatter = dest.clamp(max=spare - 1)  # combine gathers the flat order back (spare rows: any valid row)
        state = dict(
            assist=assist,
            ep_recv_counts=ep_recv_counts,
            rows=scatter,
            zero_expert_num=zero_num,
            ccl=ccl,
            elastic_info=elastic,
            op_experts=op_experts,
        )
        handle = make_handle(src_info, layout_range, n, hidden, args.num_experts, backend_state=state)
        return DispatchResult(recv_x, recv_count, handle, Completion(lambda: None))

    def combine(self, args: CombineArgs) -> CombineResult:
        idx = self._flip()
        h = args.handle
        state = h.backend_state
        if not isinstance(state, dict) or "assist" not in state:
            raise invalid("handle", "was not produced by the ascend backend's low_latency_dispatch")
        num_local, rn, hidden = h.src_info.shape[0], h.src_info.shape[1], h.hidden
        source = self._zero_copy_buffer(idx, h) if args.zero_copy else args.x
        expand_x = source.reshape(num_local * rn, hidden).index_select(0, state["rows"])
        num_tokens = args.topk_idx.shape[0]
        weights, topk_idx = _pad_empty(args.topk_weights, args.topk_idx)
        elastic = state.get("elastic_info")  # the mask as it was at dispatch
        extra = {} if elastic is None else {"elastic_info": elastic}
        if elastic is not None:
            topk_idx = remap_expert_ids(topk_idx, elastic, num_local)
        ids, _ = map_no_expert(topk_idx, state.get("op_experts", h.num_experts))
        combined = self.ops.combine(
            expand_x,
            ids,
            state["assist"],
            state["ep_recv_counts"],
            weights,
            h.num_experts,
            global_bs=h.num_max_dispatch_tokens_per_rank * self.num_ranks,
            zero_expert_num=state["zero_expert_num"],
            **extra,
        )[:num_tokens]
        out = combined if args.out is None else args.out.copy_(combined)
        return CombineResult(out, Completion(lambda: None))

    def _zero_copy_buffer(self, idx: int, handle: LowLatencyHandle) -> torch.Tensor:
        num_local, rn = handle.src_info.shape
        want = (num_local, rn, handle.hidden)
        buf = self._zero_copy.get(idx)
        if buf is None or tuple(buf.shape) != want:
            buf = torch.empty(want, dtype=torch.bfloat16, device=handle.src_info.device)
            self._zero_copy[idx] = buf
        return buf

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self._zero_copy_buffer(self._buffer_idx, handle)

    def dispatch_flat(self, params: DispatchParams) -> Completion:
        v = params.validate()  # the op's rules, checked here too (the NPU op raises on its own only on device)
        ids, zero_num = map_no_expert(v.ids, params.moe_expert_num, params.zero_expert_num)
        moe_ranks = self.num_ranks - params.shared_expert_rank_num
        num_local = params.moe_expert_num // max(moe_ranks, 1)
        ccl = self._ccl_size(params.global_bs // self.num_ranks, v.x.shape[1], num_local, ids.shape[1])
        kw = _op_keywords(params, DISPATCH_KEYWORDS, zero_expert_num=zero_num)
        outputs = self.ops.dispatch(v.x, ids, params.moe_expert_num, **kw, **self._op_kwargs(ccl))
        return Completion(lambda: outputs)

    def combine_flat(self, params: CombineParams) -> Completion:
        v = params.validate()
        ids, zero_num = map_no_expert(v.ids, params.moe_expert_num, params.zero_expert_num)
        kw = _op_keywords(params, COMBINE_KEYWORDS, zero_expert_num=zero_num)
        out = self.ops.combine(
            v.expand_x, ids, params.assist_info_for_combine, params.ep_send_counts, params.expert_scales,
            params.moe_expert_num, **kw,
        )  # fmt: skip
        return Completion(lambda: out)

    def destroy(self) -> None:
        self._zero_copy.clear()


DISPATCH_KEYWORDS = (
    "scales", "x_active_mask", "expert_scales", "quant_mode", "expert_token_nums_type", "shared_expert_num",
    "shared_expert_rank_num", "global_bs", "copy_expert_num", "const_expert_num",
)  # fmt: skip
COMBINE_KEYWORDS = (
    "x_active_mask", "expand_scales", "shared_expert_x", "ori_x", "const_expert_alpha_1", "const_expert_alpha_2",
    "const_expert_v", "comm_quant_mode", "shared_expert_num", "shared_expert_rank_num", "global_bs",
    "copy_expert_num", "const_expert_num",
)  # fmt: skip


def _op_keywords(params: DispatchParams | CombineParams, names: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """The keywords the flat methods give the op: ``names`` of ``params``, then ``extra``."""
    return {**{n: getattr(params, n) for n in names}, **extra}
