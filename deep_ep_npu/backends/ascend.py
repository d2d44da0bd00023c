"""The Ascend backend: the real MoE distribute ops, converted between DeepEP's masked layout and the flat one.

Ops, first found wins: the V3 context ops ``MoeDistributeBuffer`` of ``cann_ops_transformer.ops`` (CANN 9.1+, methods
``low_latency_dispatch/combine``) or ``npu_ops_transformer.ops`` (the same, prefixed ``npu_``), else torch_npu's
``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` on the group's HCCL communicator; ``torch_npu`` is imported when
this backend is created.

Mapping: ``-1`` in ``topk_idx`` becomes a zero expert (never sent, adds 0); ``global_bs = N * R`` lets ranks hold
fewer than N tokens (a rank with none sends one row routed nowhere: the ops need Bs >= 1); ``use_fp8=True`` is
A2/A3's per-token dynamic int8 (``quant_mode=2``). Index tensors alone (no host synchronization) gather the flat
``expand_x`` (rows expert-major, then source rank, then token) into ``recv_x`` `[L, R * N, hidden]` and, in combine,
back; ``src_info`` is the token of ``assist_info_for_combine``'s (rank, token, slot) triples (the A3 fullmesh layout).
The ops run in stream order at call time, so ``hook()`` and the event's wait have nothing left to do;
``dispatch_wait_recv_cost_stats`` is the op's ``performance_info`` (µs per source rank).

Shrink mode: the caller's mask (``low_latency_update_mask_buffer``, the same on every rank; HCCL detects no failed
rank) becomes the ops' ``elastic_info`` `[4 + 2R]` int32: ``is_scaled_down, new_rank_count R', new_shared_rank_count,
new_moe_expert_count E' = R' * L, Table1[R]`` (EP rank -> new rank or -1), ``Table2[R]`` (new rank -> EP rank, padded
with -1). Live ranks keep their L experts (``e -> Table1[e // L] * L + e % L``), masked ranks' experts become -1;
masked ranks still call the ops, sending and receiving nothing (``ep_recv_counts`` stays per EP source rank).

Limits: validation is local (no extra collective per call): a rank whose input is rejected raises, but peers that
passed enter the op and wait until the HCCL timeout, so give every rank the same N, num_experts and hidden.
``round_scale`` / ``use_ue8m0`` / fp8 e4m3 have no A2/A3 op.
"""

import contextlib
import importlib
from typing import Any

import torch
import torch.distributed as dist

from .. import envs
from ..errors import invalid, shape
from ..event import Completion
from ..handle import make_handle
from ..ll_params import CombineArgs, DispatchArgs
from ..params import CombineParams, DispatchParams
from ..sizes import ccl_buffer_bytes, ccl_buffer_mb
from . import BufferConfig, CombineResult, DispatchResult, LowLatencyBackend, hccl_comm_name, map_no_expert

# the keywords of DispatchParams / CombineParams the flat methods give the op as they are
_SHARED_KEYWORDS = ("shared_expert_num", "shared_expert_rank_num", "global_bs", "copy_expert_num", "const_expert_num")
DISPATCH_KEYWORDS = ("scales", "x_active_mask", "expert_scales", "quant_mode", "expert_token_nums_type",
                     *_SHARED_KEYWORDS)  # fmt: skip
COMBINE_KEYWORDS = ("x_active_mask", "expand_scales", "shared_expert_x", "ori_x", "const_expert_alpha_1",
                    "const_expert_alpha_2", "const_expert_v", "comm_quant_mode", *_SHARED_KEYWORDS)  # fmt: skip


def elastic_info_from_mask(mask: torch.Tensor, num_local_experts: int) -> torch.Tensor | None:
    """The ``elastic_info`` `[4 + 2R]` int32 for ``mask`` `[R]` int32 (1 = masked), or None when no rank is masked.
    Raises ValueError when every rank is masked (there is no EP left to scale down to)."""
    masked = mask.bool().tolist()
    if not any(masked):
        return None
    live = [r for r, m in enumerate(masked) if not m]
    if not live:
        raise ValueError("mask: every rank is masked; at least one rank must stay in the EP group")
    table1 = [live.index(rank) if rank in live else -1 for rank in range(len(masked))]
    head = [1, len(live), 0, len(live) * num_local_experts]
    return torch.tensor(head + table1 + live + [-1] * (len(masked) - len(live)), dtype=torch.int32)


def remap_expert_ids(topk_idx: torch.Tensor, elastic_info: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """DeepEP expert ids `[T, K]` (-1: none) -> ids over the live ranks (``elastic_info``'s Table1), with -1 for
    experts on masked ranks. Same dtype and device as ``topk_idx``."""
    table1 = elastic_info[4 : 4 + (elastic_info.numel() - 4) // 2].to(device=topk_idx.device, dtype=torch.int64)
    nl, e = num_local_experts, topk_idx.long().clamp(min=0)
    owner = table1[e // nl]
    return torch.where((topk_idx < 0) | (owner < 0), -1, owner * nl + e % nl).to(topk_idx.dtype)


def _pad_empty(rows: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU ops need Bs >= 1: a rank with no tokens sends one zero row routed nowhere (all ids -1)."""
    if topk_idx.shape[0]:
        return rows, topk_idx
    return rows.new_zeros((1, rows.shape[1])), topk_idx.new_full((1, topk_idx.shape[1]), -1)


class _TorchNpuOps:
    """``torch_npu.npu_moe_distribute_{dispatch,combine}_v2`` on the group's HCCL communicator name."""

    path = "torch_npu"
    created_ccl_buffer_size = None

    def __init__(self, torch_npu: Any, group_name: str, num_ranks: int, rank: int) -> None:
        self.torch_npu, self.ep = torch_npu, (group_name, num_ranks, rank)

    def dispatch(self, x, expert_ids, moe_expert_num: int, *, ccl_buffer_size: int = 0, **kw: Any) -> tuple:
        return tuple(self.torch_npu.npu_moe_distribute_dispatch_v2(x, expert_ids, *self.ep, moe_expert_num, **kw))

    def combine(self, expand_x, expert_ids, assist, counts, weights, moe_expert_num: int, **kw: Any) -> torch.Tensor:
        op = self.torch_npu.npu_moe_distribute_combine_v2
        return op(expand_x, expert_ids, assist, counts, weights, *self.ep, moe_expert_num, **kw)


class _ContextOps:
    """ops-transformer's ``MoeDistributeBuffer`` (the V3 context ops), created on first use with the CCL size."""

    def __init__(self, module: Any, group: dist.ProcessGroup, num_ranks: int) -> None:
        self.module, self.group, self.num_ranks = module, group, num_ranks
        self.path = module.__name__.split(".")[0]
        self.buffer: Any = None
        self.created_ccl_buffer_size: int | None = None

    def _method(self, name: str, ccl_buffer_size: int) -> Any:
        if self.buffer is None:
            self.buffer = self.module.MoeDistributeBuffer(self.group, ccl_buffer_size)
            self.created_ccl_buffer_size = ccl_buffer_size
        return getattr(self.buffer, name, None) or getattr(self.buffer, "npu_" + name)

    def dispatch(self, x, expert_ids, moe_expert_num: int, *, ccl_buffer_size: int, **kw: Any) -> tuple:
        kw["num_max_dispatch_tokens_per_rank"] = kw.pop("global_bs") // self.num_ranks
        kw["x_smooth_scale"], kw["topk_weights"] = kw.pop("scales", None), kw.pop("expert_scales", None)
        kw.pop("performance_info", None)  # not exposed by the context wrapper
        outs = self._method("low_latency_dispatch", ccl_buffer_size)(x, expert_ids, moe_expert_num, **kw)
        # the torch_npu op's outputs, without tp_recv_counts: add a `[1]` int32 zero one
        return (*outs[:5], torch.zeros((1,), dtype=torch.int32, device=outs[0].device), outs[5])

    def combine(self, expand_x, expert_ids, assist, counts, weights, moe_expert_num: int, **kw: Any) -> torch.Tensor:
        kw.update(num_experts=moe_expert_num, num_max_dispatch_tokens_per_rank=kw.pop("global_bs") // self.num_ranks)
        return self._method("low_latency_combine", 0)(expand_x, expert_ids, weights, assist, counts, **kw)


class AscendBackend(LowLatencyBackend):
    """DeepEP's low-latency API on the Ascend MoE distribute ops (see the module docstring)."""

    name = "ascend"
    native_quant_format = "int8_per_token"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        try:
            torch_npu = importlib.import_module("torch_npu")
        except ImportError as err:
            msg = "backend='ascend' needs torch_npu (pip install 'deep_ep_npu[npu]'); use backend='reference' elsewhere"
            raise ImportError(msg) from err
        super().__init__(group, config)
        for name in ("cann_ops_transformer.ops", "npu_ops_transformer.ops"):  # the V3 context ops, first found wins
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                if hasattr(module, "MoeDistributeBuffer"):
                    self.ops: Any = _ContextOps(module, group, self.num_ranks)
                    break
        else:
            self.ops = _TorchNpuOps(torch_npu, self._group_name(), self.num_ranks, self.rank)
        self._env_ccl = envs.hccl_buffsize_mb()

    @property
    def ops_path(self) -> str:
        """Which ops run: ``"cann_ops_transformer"``, ``"npu_ops_transformer"`` or ``"torch_npu"``."""
        return self.ops.path

    def _group_name(self) -> str:
        """The HCCL communicator name the torch_npu ops take as ``group_ep``."""
        return hccl_comm_name(self.group, self.rank)

    def _ccl_size(self, num_max: int, hidden: int, num_local: int, topk: int) -> int:
        """The CCL window (MB) for these shapes; raises, naming the size needed, if the one in use is smaller."""
        need = ccl_buffer_mb(ccl_buffer_bytes(self.num_ranks, num_max, hidden, num_local, topk))
        cfg, created = self.config.ccl_buffer_size, self.ops.created_ccl_buffer_size
        env = self._env_ccl if isinstance(self.ops, _TorchNpuOps) else None
        first = "ccl_buffer_size (the context was created on the first call with this size)"
        for have, source in ((cfg, "ccl_buffer_size"), (created, first), (env, "HCCL_BUFFSIZE")):
            if have is not None and have < need:
                shapes = f"R={self.num_ranks}, N={num_max}, hidden={hidden}, L={num_local}, K={topk}"
                fix = f"at least {need} MB is needed (Buffer.get_low_latency_ccl_buffer_size)"
                raise shape("ccl_buffer_size", f"{source}: {have} MB is too small for {shapes}: {fix}")
        return cfg if cfg is not None else max(need, created or 0)

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        if args.quant == "fp8_e4m3":
            raise invalid("quant_format", "fp8_e4m3 has no Ascend A2/A3 op; use_fp8 means int8_per_token here")
        self._flip()
        r, num_local = self.num_ranks, args.num_local_experts
        n, hidden = args.num_max_dispatch_tokens_per_rank, args.hidden
        x, topk_idx = _pad_empty(args.x, args.topk_idx)
        # shrink mode: masked ranks scaled out; moe_expert_num stays E, the zero experts start after the E' live ones
        op_experts, elastic, extra = args.num_experts, elastic_info_from_mask(self.mask, num_local), dict[str, Any]()
        if elastic is not None:
            topk_idx = remap_expert_ids(topk_idx, elastic, num_local)
            op_experts, extra = int(elastic[3]), {"elastic_info": elastic.to(x.device)}
        if args.dispatch_wait_recv_cost_stats is not None:
            extra["performance_info"] = args.dispatch_wait_recv_cost_stats
        ids, zero_num = map_no_expert(topk_idx, op_experts)
        ccl = self._ccl_size(n, hidden, num_local, ids.shape[1])
        extra |= dict(quant_mode=2 if args.quant else 0, global_bs=n * r, zero_expert_num=zero_num, ccl_buffer_size=ccl)
        expand_x, dynamic_scales, assist, _, ep_recv_counts, _, _ = self.ops.dispatch(x, ids, args.num_experts, **extra)
        cum = ep_recv_counts[: num_local * r].long()
        counts = cum.diff(prepend=cum.new_zeros(1)).view(num_local, r)
        per_expert = counts.sum(dim=1)
        end = per_expert.cumsum(0)
        # flat row -> its row in the masked layout; rows past the received total go to a spare row at the end, so
        # only the A flat rows are moved (not L * R * N) and nothing needs the counts on the host
        rn, spare = r * n, num_local * r * n
        rows = torch.arange(expand_x.shape[0], device=end.device)
        expert_of_row = torch.searchsorted(end, rows, right=True)
        expert = expert_of_row.clamp(max=num_local - 1)
        dest = torch.where(expert_of_row < num_local, expert * rn + rows - (end - per_expert)[expert], spare)

        def gather(flat: torch.Tensor) -> torch.Tensor:
            return flat.new_empty((spare + 1, *flat.shape[1:])).index_copy_(0, dest, flat)[:spare]

        recv_x: Any = gather(expand_x).view(num_local, rn, hidden)
        if args.quant:
            scales = gather(dynamic_scales[: rows.numel()]).view(num_local, rn, 1)
            recv_x = (recv_x, scales.expand(-1, -1, hidden // 128))
        src_info = gather(assist.view(-1)[3 * rows + 1].to(torch.int32)).view(num_local, rn)
        layout_range = ((counts.cumsum(1) - counts) << 32) | counts
        recv_count = per_expert.to(torch.int32)
        if args.cumulative_local_expert_recv_stats is not None:
            args.cumulative_local_expert_recv_stats += recv_count
        # elastic_info: the mask as it was at dispatch; rows: combine gathers the flat order back (spare: any row)
        state = dict(assist=assist, ep_recv_counts=ep_recv_counts, zero_expert_num=zero_num, op_experts=op_experts,
                     elastic_info=extra.get("elastic_info"), rows=dest.clamp(max=spare - 1))  # fmt: skip
        handle = make_handle(src_info, layout_range, n, hidden, args.num_experts, backend_state=state)
        return DispatchResult(recv_x, recv_count, handle, Completion(lambda: None))

    def combine(self, args: CombineArgs) -> CombineResult:
        if args.use_logfmt:
            raise invalid("use_logfmt", "no Ascend combine op takes DeepEP's LogFMT-10 rows (its comm_quant_mode 2 is "
                          "int8 with per-8 scales): pass use_logfmt=False, or use backend='reference'")  # fmt: skip
        idx, h, state = self._flip(), args.handle, args.handle.backend_state
        if not isinstance(state, dict) or "assist" not in state:
            raise invalid("handle", "was not produced by the ascend backend's low_latency_dispatch")
        num_local, rn = h.src_info.shape
        source = self._zero_copy_buffer(idx, h) if args.zero_copy else args.x
        expand_x = source.reshape(num_local * rn, h.hidden).index_select(0, state["rows"])
        weights, topk_idx = _pad_empty(args.topk_weights, args.topk_idx)
        elastic = state["elastic_info"]
        topk_idx = topk_idx if elastic is None else remap_expert_ids(topk_idx, elastic, num_local)
        ids, _ = map_no_expert(topk_idx, state["op_experts"])
        combined = self.ops.combine(
            expand_x, ids, state["assist"], state["ep_recv_counts"], weights, h.num_experts,
            global_bs=h.num_max_dispatch_tokens_per_rank * self.num_ranks, zero_expert_num=state["zero_expert_num"],
            **({} if elastic is None else {"elastic_info": elastic}),
        )[: args.topk_idx.shape[0]]  # fmt: skip
        out = combined if args.out is None else args.out.copy_(combined)
        return CombineResult(out, Completion(lambda: None))

    def dispatch_flat(self, params: DispatchParams) -> Completion:
        v = params.validate()  # the op's rules, checked here too (the NPU op raises on its own only on device)
        ids, zero_num = map_no_expert(v.ids, params.moe_expert_num, params.zero_expert_num)
        num_local = params.moe_expert_num // max(self.num_ranks - params.shared_expert_rank_num, 1)
        ccl = self._ccl_size(params.global_bs // self.num_ranks, v.x.shape[1], num_local, ids.shape[1])
        kw = {name: getattr(params, name) for name in DISPATCH_KEYWORDS} | {"zero_expert_num": zero_num}
        outputs = self.ops.dispatch(v.x, ids, params.moe_expert_num, **kw, ccl_buffer_size=ccl)
        return Completion(lambda: outputs)

    def combine_flat(self, params: CombineParams) -> Completion:
        v = params.validate()
        ids, zero_num = map_no_expert(v.ids, params.moe_expert_num, params.zero_expert_num)
        kw = {name: getattr(params, name) for name in COMBINE_KEYWORDS} | {"zero_expert_num": zero_num}
        out = self.ops.combine(v.expand_x, ids, params.assist_info_for_combine, params.ep_send_counts,
                               params.expert_scales, params.moe_expert_num, **kw)  # fmt: skip
        return Completion(lambda: out)
