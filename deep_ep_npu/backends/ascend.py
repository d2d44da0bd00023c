"""The ``ascend`` backend: the real MoE distribute ops (:mod:`.ascend_ops` finds them: CANN's V3 context ops, else
torch_npu's ``_v2`` ops), every front-end's layout converted to and from the flat one; MegaMoE: :mod:`.ascend_mega`.

DeepEP's masked calls: ``-1`` ids become a zero expert, ``global_bs = N * R`` (a rank with no tokens sends one row
routed nowhere), ``use_fp8`` is A2/A3's per-token int8; index tensors (no host sync) move the flat rows into
``recv_x`` `[L, R * N, hidden]` and back. V2's calls: one ``dispatch_v2`` placed as the reference backend places it
(:mod:`.ascend_v2`). Shrink mode: the mask becomes the ops' ``elastic_info`` (:func:`elastic_info_from_mask`).
Validation is local: a rejected rank raises, but peers that passed wait in the op until the HCCL timeout."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from ..core.call import FFN, CombineCall, DispatchCall
from ..engine.exchange import InFlight, engine_for
from ..errors import invalid
from ..handle import LowLatencyHandle
from . import Backend
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
    head = [1, len(live), 0, len(live) * num_local_experts]
    return torch.tensor(head + table1 + live + [-1] * (len(masked) - len(live)), dtype=torch.int32)


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
        self.ws: dict[str, torch.Tensor] = {}
        self.tag = 0

    @property
    def ops_path(self) -> str:
        """Which ops run: ``"cann_ops_transformer"``, ``"npu_ops_transformer"`` or ``"torch_npu"``."""
        return self.ops.path

    def reject(self, op: str, code: int, tp: Any = None) -> None:
        """Nothing to tell: the ops validate locally (see the module docstring's limits)."""

    def dispatch(self, call: DispatchCall) -> InFlight:
        self.tag ^= 1
        run = {"masked": self._masked_dispatch, "flat": self._flat_dispatch, "expand": self._expand_dispatch}
        return InFlight(None, run[call.layout](call))

    def combine(self, call: CombineCall) -> InFlight:
        self.tag ^= 1
        run = {"masked": self._masked_combine, "flat": self._flat_combine, "expand": self._expand_combine}
        return InFlight(None, run[call.layout](call))

    def _flat_dispatch(self, c: DispatchCall) -> tuple[torch.Tensor, ...]:
        e, q = c.experts, c.quant
        ids, zero_num = map_no_expert(c.expert_ids, e.num_moe_experts, e.zero_expert_num)
        kw = dict(scales=c.scales, x_active_mask=c.x_active_mask, expert_scales=c.expert_scales,
                  quant_mode=0 if q is None else q.mode, expert_token_nums_type=c.expert_token_nums_type,
                  shared_expert_num=max(e.shared_expert_num, 1), shared_expert_rank_num=e.shared_expert_rank_num,
                  global_bs=c.num_max * e.world_size, copy_expert_num=e.copy_expert_num,
                  const_expert_num=e.const_expert_num, zero_expert_num=zero_num)  # fmt: skip
        return self.ops.dispatch(c.x, ids, e.num_moe_experts, c.num_max, e.num_local, **kw)

    def _flat_combine(self, c: CombineCall) -> torch.Tensor:
        e, (assist, counts, _) = c.experts, c.handle
        ids, zero_num = map_no_expert(c.expert_ids, e.num_moe_experts, e.zero_expert_num)
        kw = dict(x_active_mask=c.x_active_mask, shared_expert_x=c.shared_expert_x, ori_x=c.ori_x,
                  const_expert_alpha_1=c.const_expert_alpha_1, const_expert_alpha_2=c.const_expert_alpha_2,
                  const_expert_v=c.const_expert_v, comm_quant_mode=c.comm_quant_mode,
                  shared_expert_num=max(e.shared_expert_num, 1), shared_expert_rank_num=e.shared_expert_rank_num,
                  global_bs=c.global_bs, copy_expert_num=e.copy_expert_num, const_expert_num=e.const_expert_num,
                  zero_expert_num=zero_num)  # fmt: skip
        combined = self.ops.combine(c.x, ids, assist, counts, c.expert_scales, e.num_moe_experts, **kw)
        return combined if c.out is None else c.out.copy_(combined)

    def _masked_dispatch(self, c: DispatchCall) -> tuple[Any, torch.Tensor, LowLatencyHandle]:
        if c.quant == "fp8_e4m3":
            raise invalid("quant_format", "fp8_e4m3 has no Ascend A2/A3 op; use_fp8 means int8_per_token here")
        r, num_local, n, hidden = self.num_ranks, c.experts.num_local, c.num_max, c.x.shape[1]
        x, topk_idx = pad_empty(c.x, c.expert_ids)
        # shrink mode: masked ranks scaled out; moe_expert_num stays E, the zero experts start after the E' live ones
        op_experts, elastic, extra = c.experts.num_moe_experts, elastic_info_from_mask(self.mask, num_local), {}
        if elastic is not None:
            topk_idx = remap_expert_ids(topk_idx, elastic, num_local)
            op_experts, extra = int(elastic[3]), {"elastic_info": elastic.to(x.device)}
        if c.wait_stats is not None:
            extra["performance_info"] = c.wait_stats
        ids, zero_num = map_no_expert(topk_idx, op_experts)
        expand_x, dynamic_scales, assist, _, ep_recv_counts, _, _ = self.ops.dispatch(
            x, ids, c.experts.num_moe_experts, n, num_local, quant_mode=2 if c.quant else 0, global_bs=n * r,
            zero_expert_num=zero_num, **extra,
        )  # fmt: skip
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
        if c.quant:
            scales = gather(dynamic_scales[: rows.numel()]).view(num_local, rn, 1)
            recv_x = (recv_x, scales.expand(-1, -1, hidden // 128))
        src_info = gather(assist.view(-1)[3 * rows + 1].to(torch.int32)).view(num_local, rn)
        layout_range = ((counts.cumsum(1) - counts) << 32) | counts
        recv_count = per_expert.to(torch.int32)
        if c.recv_stats is not None:
            c.recv_stats += recv_count
        handle = LowLatencyHandle(src_info, layout_range, n, hidden, c.experts.num_moe_experts)
        # elastic_info: the mask as it was at dispatch; rows: combine gathers the flat order back (spare: any row)
        handle.backend_state = dict(assist=assist, ep_recv_counts=ep_recv_counts, zero_expert_num=zero_num,
                                    op_experts=op_experts, elastic_info=extra.get("elastic_info"),
                                    rows=dest.clamp(max=spare - 1))  # fmt: skip
        return recv_x, recv_count, handle

    def _masked_combine(self, c: CombineCall) -> torch.Tensor:
        if c.comm_quant_mode:
            raise invalid("use_logfmt", "no Ascend combine op takes DeepEP's LogFMT-10 rows (its comm_quant_mode 2 is "
                          "int8 with per-8 scales): pass use_logfmt=False, or use backend='reference'")  # fmt: skip
        h, state = c.handle, c.handle.backend_state
        if not isinstance(state, dict) or "assist" not in state:
            raise invalid("handle", "was not produced by the ascend backend's low_latency_dispatch")
        num_local, rn = h.src_info.shape
        source = self.next_combine_buffer(h, self.tag) if c.zero_copy else c.x
        expand_x = source.reshape(num_local * rn, h.hidden).index_select(0, state["rows"])
        weights, topk_idx = pad_empty(c.expert_scales, c.expert_ids)
        elastic = state["elastic_info"]
        topk_idx = topk_idx if elastic is None else remap_expert_ids(topk_idx, elastic, num_local)
        ids, _ = map_no_expert(topk_idx, state["op_experts"])
        combined = self.ops.combine(
            expand_x, ids, state["assist"], state["ep_recv_counts"], weights, h.num_experts,
            global_bs=h.num_max_dispatch_tokens_per_rank * self.num_ranks, zero_expert_num=state["zero_expert_num"],
            **({} if elastic is None else {"elastic_info": elastic}),
        )[: c.expert_ids.shape[0]]  # fmt: skip
        return combined if c.out is None else c.out.copy_(combined)

    def _expand_dispatch(self, c: DispatchCall) -> Any:
        if c.x_sf is not None:
            raise invalid("x", "the pre-quantized (float8_e4m3fn, sf) tuple has no Ascend A2/A3 dispatch op (quant_mode"
                          " 0 takes bf16 / fp16 x): pass bf16 x, or use backend='reference'")  # fmt: skip
        from .ascend_v2 import dispatch

        return dispatch(self, c)

    def _expand_combine(self, c: CombineCall) -> torch.Tensor:
        from .ascend_v2 import combine

        return combine(self, c)

    def can_fuse(self, call: DispatchCall, ffn: FFN) -> bool:
        op, device_type = self.ops.fused_op, self.ops.device_type
        return op is not None and call.x.device.type == device_type and fused_op_blocker(call, ffn) is None

    def mega_moe(self, call: DispatchCall, ffn: FFN, fused: bool) -> torch.Tensor:
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
