"""``ElasticBuffer`` on the Ascend MoE distribute ops (the ``ascend`` backend's ops: ops-transformer's V3 context
ops or torch_npu's ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``; on any machine, :mod:`deep_ep_npu.sim`).

Dispatch is one ``dispatch_v2`` (``quant_mode=0``, ``global_bs = N * R``, -1 mapped onto zero experts, the weights as
``expert_scales``): its ``expand_x`` (rows by local expert, then source rank, then token) and the (source rank,
token, slot) triples of ``assist_info_for_combine`` (the A3 fullmesh layout) give both V2 layouts, placed exactly
as the reference backend places them (:mod:`deep_ep_npu.engine.elastic`). Combine is one ``combine_v2`` with unit
``expert_scales``: each rank's returned row (non-expand: the caller's pre-reduced row; expand: the token's rows
summed in top-k order, or every row without multiple reduction) in the slot of its last expert there, zeros in the
other slots, and one ``bias`` as ``shared_expert_x``. The op adds ``shared_expert_x`` after the routed rows, so a
bias is added last here (DeepEP adds it first: the fp32 rounding can differ).

What cannot be mapped raises :class:`~deep_ep_npu.MoeDistributeError` naming it: the fp8 tuple ``x`` (no A2/A3 op
takes fp8 data; ``quant_mode=0`` takes bf16 / fp16), two biases (one ``shared_expert_x``), and combine's
``topk_weights`` (no op carries per-slot values back, so there is no ``combined_topk_weights``). A cached handle
runs the op again (its count exchange is inside the op) and places rows at the handle's positions. Validation is
local, as the legacy ascend backend's: a rank that rejects its input raises, its peers wait in the op until the HCCL
timeout.
"""

from __future__ import annotations

from typing import Any

import torch

from ..elastic_params import Combine, Dispatch
from ..engine.elastic import ElasticLayout, Placement, make_placement
from ..engine.plan import make_plan
from ..ep_handle import EPHandle
from ..errors import invalid
from ..event import Completion
from . import map_no_expert
from .ascend import AscendBackend, _pad_empty
from .elastic_reference import aligned_counts, reduce_expanded, slot_idx


class ElasticAscend:
    """DeepEP V2 semantics on the Ascend ops of ``backend`` (see the module docstring)."""

    def __init__(self, backend: AscendBackend, owner: object, allow_multiple_reduction: bool) -> None:
        self.backend, self.owner, self.multiple_reduction = backend, owner, allow_multiple_reduction
        self.rank, self.num_ranks = backend.rank, backend.num_ranks

    def reject_dispatch(self, code: int) -> None:
        """Validation is local on this backend (see the module docstring): nothing to tell the peers."""

    def reject_combine(self, code: int) -> None:
        """As :meth:`reject_dispatch`."""

    def dispatch(self, d: Dispatch) -> tuple[ElasticLayout, EPHandle | None, Completion]:
        if d.sf is not None:
            raise invalid("x", "the pre-quantized (float8_e4m3fn, sf) tuple has no Ascend A2/A3 dispatch op (quant_mode"
                          " 0 takes bf16 / fp16 x): pass bf16 x, or use backend='reference'")  # fmt: skip
        r, num_local, n, k, hidden = self.num_ranks, d.num_local, d.num_max, d.topk_idx.shape[1], d.x.shape[1]
        x, topk_idx = _pad_empty(d.x, d.topk_idx)
        ids, zero_num = map_no_expert(topk_idx, d.num_experts)
        extra: dict[str, Any] = dict(quant_mode=0, global_bs=n * r, zero_expert_num=zero_num, expert_token_nums_type=1,
                                     ccl_buffer_size=self.backend._ccl_size(n, hidden, num_local, k))  # fmt: skip
        if d.topk_weights is not None:
            extra["expert_scales"] = _pad_empty(d.topk_weights, d.topk_idx)[0]
        expand_x, _, assist, token_nums, ep_recv_counts, _, expand_scales = self.backend.ops.dispatch(
            x, ids, d.num_experts, **extra
        )
        counts = token_nums[:num_local].long()
        num_pairs = int(counts.sum())
        src, token, slot = assist.view(-1)[: 3 * num_pairs].view(num_pairs, 3).long().unbind(1)
        expert = torch.repeat_interleave(torch.arange(num_local, device=counts.device), counts, output_size=num_pairs)
        keys, row = torch.unique(src * n + token, sorted=True, return_inverse=True)  # tokens by (source, token)
        slots = torch.full((keys.numel(), k), -1, dtype=torch.int32, device=counts.device)
        slots[row, slot] = expert.to(torch.int32)
        rows_from = torch.bincount(keys // n, minlength=r).tolist()
        h = d.handle
        place: Placement = h.state["placement"] if h is not None else make_placement(
            slots, rows_from, num_local, d.alignment, d.sizes)  # fmt: skip
        layout = ElasticLayout(self.rank, r, n, num_local, d.payload, d.alignment, d.do_expand, d.zero_padding,
                               d.tma_sf, d.x.device, d.sizes, None if h is None else place)  # fmt: skip
        x_rows = expand_x.new_empty((keys.numel(), hidden))
        x_rows[row] = expand_x[:num_pairs]  # every copy of a token holds the same row
        weights = torch.zeros((keys.numel(), k), dtype=torch.float32, device=counts.device)
        if d.topk_weights is not None:
            weights[row, slot] = expand_scales[:num_pairs].float()  # this rank's slots only (0 elsewhere)
        layout.fill(place, x_rows, None, weights, (keys % n).to(torch.int32))
        if d.stats is not None:
            d.stats += counts.to(torch.int32)
        op = dict(ids=ids, assist=assist, ep_recv_counts=ep_recv_counts, zero_num=zero_num, row=row, slot=slot,
                  num_op_rows=expand_x.shape[0])  # fmt: skip
        handle = h if h is not None else self._handle(d, layout)
        handle.state.update(op=op, placement=place)
        return layout, handle, Completion(lambda: handle)

    def _handle(self, d: Dispatch, layout: ElasticLayout) -> EPHandle:
        out, place = layout.outputs, layout.placement
        assert place is not None
        num_rows, num_expanded = d.sizes or (place.num_rows, place.num_expanded)
        listed = aligned_counts(place.counts, d.alignment).tolist() if d.do_cpu_sync else []
        ids = d.topk_idx.long()
        token, slot = (ids >= 0).nonzero(as_tuple=True)
        e = ids[token, slot]
        plan = make_plan(token, slot, e // d.num_local, e % d.num_local, num_tokens=len(ids), num_ranks=self.num_ranks,
                         rank=self.rank, num_local_experts=d.num_local, per_pair_rows=False)  # fmt: skip
        return EPHandle(
            d.do_expand, d.num_experts, d.alignment, d.num_max, d.num_sms,
            d.topk_idx.clone() if d.handle_copy else d.topk_idx, num_rows, num_expanded if d.do_expand else 0,
            listed, out["psum_per_rank"], out["psum_per_expert"], out["counts"], out["metadata"],  # type: ignore[arg-type]
            slot_idx(plan, d.topk_idx, self.rank), dict(owner=self.owner, payload=d.payload),
        )  # fmt: skip

    def combine(self, c: Combine) -> tuple[torch.Tensor, torch.Tensor | None, Completion]:
        if c.topk_weights is not None:
            raise invalid("topk_weights", "no Ascend combine op carries per-slot values back (no "
                          "combined_topk_weights): pass None, or use backend='reference'")  # fmt: skip
        if len(c.biases) > 1:
            raise invalid("bias", "the Ascend combine adds one shared_expert_x: pass one bias (their sum), or use "
                          "backend='reference'")  # fmt: skip
        h, x = c.handle, c.x
        op, place = h.state["op"], h.state["placement"]
        total, k = sum(place.rows_from), h.num_topk
        meta = h.recv_src_metadata[:total]
        row, slot = op["row"], op["slot"]
        rows = torch.zeros((op["num_op_rows"], x.shape[1]), dtype=x.dtype, device=x.device)
        if h.do_expand and not self.multiple_reduction:  # every expand row, in its own slot
            rows[: row.numel()] = x.index_select(0, meta[row, 2 + slot].long())
        else:  # one row per (token, rank), in the slot of its last expert here
            partial = reduce_expanded(x, meta[:, 2:]) if h.do_expand else x[:total]
            last = torch.where(place.slots >= 0, torch.arange(k, device=x.device), -1).amax(dim=1)
            is_last = (slot == last[row]).unsqueeze(1)
            rows[: row.numel()] = torch.where(is_last, partial.index_select(0, row), 0)
        num_tokens = h.num_tokens
        ones = torch.ones((max(num_tokens, 1), k), dtype=torch.float32, device=x.device)
        extra: dict[str, Any] = {}
        if c.biases:
            extra["shared_expert_x"] = _pad_empty(c.biases[0], h.topk_idx)[0]
        combined = self.backend.ops.combine(
            rows, op["ids"], op["assist"], op["ep_recv_counts"], ones, h.num_experts,
            global_bs=h.num_max_tokens_per_rank * self.num_ranks, zero_expert_num=op["zero_num"], **extra,
        )[:num_tokens]  # fmt: skip
        return combined, None, Completion(lambda: None)
