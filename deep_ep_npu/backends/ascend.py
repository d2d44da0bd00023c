"""The ``ascend`` backend: the real MoE distribute ops (:mod:`.ascend_ops` finds them), every front-end's layout
converted to and from the flat one (``docs/buffer.md``, "Backends"); MegaMoE: :mod:`.ascend_mega`, V2's layouts:
:mod:`.ascend_v2`. DeepEP's masked calls: ``global_bs = N * R``, index tensors (no host sync) move the flat rows into
``recv_x`` `[L, R * N, hidden]` and back. Validation is local: a rejected rank raises, but peers wait in the op (HCCL
timeout)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from ..backends import InFlight
from ..core.call import (
    FFN,
    CombineCall,
    DispatchCall,
    FlatCombine,
    FlatDispatch,
    FusedCall,
    MaskedCombine,
    MaskedDispatch,
)
from ..engine.exchange import engine_for
from ..errors import invalid
from ..handle import LowLatencyHandle
from . import Backend, ascend_v2
from .ascend_mega import fused_mega_moe, fused_op_blocker
from .ascend_ops import find_ops, map_no_expert, pad_empty


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
    table2 = live + [-1] * (len(masked) - len(live))
    return torch.tensor([1, len(live), 0, len(live) * num_local_experts, *table1, *table2], dtype=torch.int32)


def remap_expert_ids(topk_idx: torch.Tensor, elastic_info: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """DeepEP expert ids `[T, K]` (-1: none) -> ids over the live ranks (``elastic_info``'s Table1), with -1 for
    experts on masked ranks. Same dtype and device as ``topk_idx``."""
    table1 = elastic_info[4 : 4 + (elastic_info.numel() - 4) // 2].to(device=topk_idx.device, dtype=torch.int64)
    nl, e = num_local_experts, topk_idx.long().clamp(min=0)
    owner = table1[e // nl]
    return torch.where((topk_idx < 0) | (owner < 0), -1, owner * nl + e % nl).to(topk_idx.dtype)


class AscendBackend(Backend):
    """Every front-end's calls on the Ascend MoE distribute ops (see the module docstring)."""

    name = "ascend"
    native_quant_format = "int8_per_token"

    def __init__(self, group: dist.ProcessGroup, **options: Any) -> None:
        try:
            torch_npu = importlib.import_module("torch_npu")
        except ImportError as err:
            msg = "backend='ascend' needs torch_npu (pip install 'deep_ep_npu[npu]'); use backend='reference' elsewhere"
            raise ImportError(msg) from err
        super().__init__(group, **options)
        self.ops = find_ops(torch_npu, group, self.ccl_buffer_size)
        self.ops_path = self.ops.path  # "cann_ops_transformer", "npu_ops_transformer" or "torch_npu"
        self.ws: dict[str, torch.Tensor] = {}
        self.tag = 0
        self._elastic: tuple[tuple[object, ...], torch.Tensor | None, int] | None = None  # (key, info, op experts)
        self.agreed = set()

    def reject(self, op: str, code: int, tp: Any = None) -> None:
        """Nothing to tell: the ops validate locally (see the module docstring's limits)."""

    def dispatch(self, call: DispatchCall) -> InFlight:
        self.tag ^= 1
        if isinstance(call, MaskedDispatch):
            return InFlight(None, self._masked_dispatch(call))
        if isinstance(call, FlatDispatch):
            return InFlight(None, self._flat_dispatch(call))
        return InFlight(None, ascend_v2.dispatch(self, call))

    def combine(self, call: CombineCall) -> InFlight:
        self.tag ^= 1
        if isinstance(call, MaskedCombine):
            return InFlight(None, self._masked_combine(call))
        if isinstance(call, FlatCombine):
            return InFlight(None, self._flat_combine(call))
        return InFlight(None, ascend_v2.combine(self, call))

    def _flat_dispatch(self, c: FlatDispatch) -> tuple[torch.Tensor, ...]:
        e, q = c.experts, c.quant
        ids, zero_num = map_no_expert(c.expert_ids, e.num_moe_experts, e.zero_expert_num)
        kw = dict(
            scales=c.scales,
            x_active_mask=c.x_active_mask,
            expert_scales=c.expert_scales,
            quant_mode=0 if q is None else q.mode,
            expert_token_nums_type=c.expert_token_nums_type,
            shared_expert_num=max(e.shared_expert_num, 1),
            shared_expert_rank_num=e.shared_expert_rank_num,
            global_bs=c.num_max * e.world_size,
            copy_expert_num=e.copy_expert_num,
            const_expert_num=e.const_expert_num,
            zero_expert_num=zero_num,
        )
        return self.ops.dispatch(c.x, ids, e.num_moe_experts, c.num_max, e.num_local, **kw)

    def _flat_combine(self, c: FlatCombine) -> torch.Tensor:
        e, (assist, counts, _) = c.experts, c.handle
        ids, zero_num = map_no_expert(c.expert_ids, e.num_moe_experts, e.zero_expert_num)
        kw = dict(
            x_active_mask=c.x_active_mask,
            shared_expert_x=c.shared_expert_x,
            ori_x=c.ori_x,
            const_expert_alpha_1=c.const_expert_alpha_1,
            const_expert_alpha_2=c.const_expert_alpha_2,
            const_expert_v=c.const_expert_v,
            comm_quant_mode=c.comm_quant_mode,
            shared_expert_num=max(e.shared_expert_num, 1),
            shared_expert_rank_num=e.shared_expert_rank_num,
            global_bs=c.global_bs,
            copy_expert_num=e.copy_expert_num,
            const_expert_num=e.const_expert_num,
            zero_expert_num=zero_num,
        )
        combined = self.ops.combine(c.x, ids, assist, counts, c.expert_scales, e.num_moe_experts, **kw)
        return combined if c.out is None else c.out.copy_(combined)

    def elastic_info(self, num_local: int, device: torch.device) -> tuple[torch.Tensor | None, int]:
        """The shrink mask's ``elastic_info`` on ``device`` (None when no rank is masked) and the op's expert count
        (the live ranks' experts): built when the mask changes (``low_latency_update_mask_buffer`` /
        ``clean_mask_buffer``, a failed rank: the host mask's version), the only time the mask is read."""
        key = (self.mask._version, num_local, device)
        if self._elastic is None or self._elastic[0] != key:
            info = elastic_info_from_mask(self.mask, num_local)
            experts = self.num_ranks * num_local if info is None else int(info[3])
            self._elastic = key, None if info is None else info.to(device), experts
        return self._elastic[1], self._elastic[2]

    def _masked_dispatch(self, c: MaskedDispatch) -> tuple[Any, torch.Tensor, LowLatencyHandle]:
        if c.quant is not None and c.quant.deepep:
            raise invalid("quant_format", "fp8_e4m3 has no Ascend A2/A3 op; use_fp8 means int8_per_token here")
        r, num_local, n, hidden = self.num_ranks, c.experts.num_local, c.num_max, c.x.shape[1]
        x, topk_idx = pad_empty(c.x, c.expert_ids)
        # shrink mode: masked ranks scaled out; moe_expert_num stays E, the zero experts start after the E' live ones
        elastic, op_experts = self.elastic_info(num_local, x.device)
        kw: dict[str, Any] = {}
        if elastic is not None:
            topk_idx, kw["elastic_info"] = remap_expert_ids(topk_idx, elastic, num_local), elastic
        ids, kw["zero_expert_num"] = map_no_expert(topk_idx, op_experts)
        kw["global_bs"] = n * r  # kw: the combine's too (elastic_info: the mask as it was at dispatch)
        perf = {} if c.wait_stats is None else {"performance_info": c.wait_stats}
        expand_x, dynamic_scales, assist, _, ep_recv_counts, _, _ = self.ops.dispatch(
            x, ids, c.experts.num_moe_experts, n, num_local, quant_mode=0 if c.quant is None else 2, **perf, **kw
        )
        cum = ep_recv_counts[: num_local * r].long()
        counts = cum.diff(prepend=cum.new_zeros(1)).view(num_local, r)
        per_expert = counts.sum(dim=1)
        end = per_expert.cumsum(0)
        # flat row -> its row in the masked layout; rows past the received total go to a spare row at the end, so
        # only the A flat rows are moved (not L * R * N) and nothing needs the counts on the host
        rn, spare = r * n, num_local * r * n
        flat_rows = torch.arange(expand_x.shape[0], device=end.device)
        expert_of_row = torch.searchsorted(end, flat_rows, right=True)
        expert = expert_of_row.clamp(max=num_local - 1)
        dest = torch.where(expert_of_row < num_local, expert * rn + flat_rows - (end - per_expert)[expert], spare)

        def gather(flat: torch.Tensor) -> torch.Tensor:
            return flat.new_empty((spare + 1, *flat.shape[1:])).index_copy_(0, dest, flat)[:spare]

        recv_x: Any = gather(expand_x).view(num_local, rn, hidden)
        if c.quant is not None:
            scales = gather(dynamic_scales[: flat_rows.numel()]).view(num_local, rn, 1)
            recv_x = (recv_x, scales.expand(-1, -1, hidden // 128))
        src_info = gather(assist.view(-1)[3 * flat_rows + 1].to(torch.int32)).view(num_local, rn)
        layout_range = ((counts.cumsum(1) - counts) << 32) | counts
        recv_count = per_expert.to(torch.int32)
        if c.recv_stats is not None:
            c.recv_stats.add_(recv_count)
        handle = LowLatencyHandle(src_info, layout_range, n, hidden, c.experts.num_moe_experts)
        rows = dest.clamp(max=spare - 1)  # combine gathers the flat order back (spare: any row)
        handle.backend_state = dict(assist=assist, counts=ep_recv_counts, op_experts=op_experts, kw=kw, rows=rows)
        return recv_x, recv_count, handle

    def _masked_combine(self, c: MaskedCombine) -> torch.Tensor:
        if c.logfmt:
            why = "no Ascend combine op takes DeepEP's LogFMT-10 rows (its comm_quant_mode 2 is int8 with per-8 scales)"
            raise invalid("use_logfmt", why + ": pass use_logfmt=False, or use backend='reference'")
        h, state = c.handle, c.handle.backend_state
        if not isinstance(state, dict) or "assist" not in state:
            raise invalid("handle", "was not produced by the ascend backend's low_latency_dispatch")
        num_local, rn = h.src_info.shape
        source = self.next_combine_buffer(h, self.tag) if c.zero_copy else c.x
        expand_x = source.reshape(num_local * rn, h.hidden).index_select(0, state["rows"])
        weights, topk_idx = pad_empty(c.expert_scales, c.expert_ids)
        if (elastic := state["kw"].get("elastic_info")) is not None:
            topk_idx = remap_expert_ids(topk_idx, elastic, num_local)
        ids, _ = map_no_expert(topk_idx, state["op_experts"])
        args = (expand_x, ids, state["assist"], state["counts"], weights, h.num_experts)
        combined = self.ops.combine(*args, **state["kw"])[: c.expert_ids.shape[0]]
        return combined if c.out is None else c.out.copy_(combined)

    def can_fuse(self, call: FusedCall, ffn: FFN) -> bool:
        op, device_type = self.ops.fused_op, self.ops.device_type
        return op is not None and call.x.device.type == device_type and fused_op_blocker(call, ffn) is None

    def mega_moe(self, call: FusedCall, ffn: FFN, fused: bool) -> torch.Tensor:
        if not fused:  # the reference pipeline on the group (its own engine: the op's group, not the Buffer's)
            from ..engine.pipeline import run

            return run(engine_for(self.group), call, ffn)
        return fused_mega_moe(self.ops, self.group, self.rank, call, ffn)

    def next_combine_buffer(self, handle: Any, tag: int | None = None) -> torch.Tensor:
        key = f"zero_copy{self.tag ^ 1 if tag is None else tag}"
        shape = (*handle.src_info.shape, handle.hidden)
        if key not in self.ws or self.ws[key].shape != shape or self.ws[key].device != handle.src_info.device:
            self.ws[key] = torch.empty(shape, dtype=torch.bfloat16, device=handle.src_info.device)
        return self.ws[key]

    def clean(self) -> None:
        self.tag = 0

    def destroy(self) -> None:
        self.ws.clear()
