"""The reference backend: DeepEP's low-latency calls on the engine (:mod:`deep_ep_npu.engine`), masked layout.

Works on any torch.distributed group and device (gloo on CPU, NCCL on CUDA, HCCL on NPU tensors): every buffer
lives on the input's device. Dispatch sends each token once per destination rank with the local experts it is for
and expands it into ``recv_x`` `[L, R * N, hidden]`; inside local expert i, source rank j owns rows
``[begin, begin + count)`` (this rank's own block first, then the other sources in rank order; tokens ascending).
Combine returns the rows in the order the source's ``topk_idx`` predicts and reduces them there in fp32.

Buffers: the wire buffers are owned by the backend, grown on demand and double-buffered like DeepEP's (index
flipped by every dispatch and combine). Dispatch results (``recv_x``, scales, ``recv_count``, the handle's tensors)
live in two alternating sets, so they stay valid until the next-but-one dispatch (DeepEP: do not hold more than 2
low-latency results); combine results are fresh tensors (or ``out``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import profiling
from ..engine.combine import CombineJob, start_combine
from ..engine.dispatch import DispatchJob, start_dispatch
from ..engine.flat import DTYPE_CODES, start_combine_flat, start_dispatch_flat
from ..engine.layouts import Masked
from ..engine.plan import make_plan
from ..engine.rows import QUANTS, ReturnFormat, RowFormat
from ..engine.workspace import Workspace
from ..errors import MoeDistributeError
from ..event import Completion
from ..handle import make_handle
from ..ll_params import CombineArgs, DispatchArgs
from ..params import CombineParams, DispatchParams
from .base import BufferConfig, CombineResult, DispatchResult, LowLatencyBackend

COMBINE_NAMES = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype")


class ReferenceBackend(LowLatencyBackend):
    """DeepEP low-latency semantics on the engine (see the module docstring)."""

    name = "reference"
    native_quant_format = "fp8_e4m3"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        super().__init__(group, config)
        self._ws = Workspace()
        self._buffer_idx = 0  # wire buffers: flips on every dispatch and combine
        self._dispatch_idx = 0  # dispatch results: flips on every dispatch

    def _flip(self) -> int:
        idx, self._buffer_idx = self._buffer_idx, self._buffer_idx ^ 1
        return idx

    def _rewind(self, state: tuple[int, int]) -> None:
        self._buffer_idx, self._dispatch_idx = state

    def abort(self, op: str, code: int) -> None:
        r = self.num_ranks
        counts = [[0, 0] for _ in range(r)] if op == "dispatch" else [[] for _ in range(r)]
        width = len(Masked.names) if op == "dispatch" else 2 * r + len(COMBINE_NAMES)
        self.ep.start_agree(f"low_latency_{op}", code, counts, [0] * width)()

    def _pairs(self, topk_idx: torch.Tensor, num_local: int):
        """(token, slot, dest rank, local expert) `[num_pairs]` int64 of the valid entries of ``topk_idx``."""
        ids = topk_idx.long()
        valid = ids >= 0
        if bool(self.mask.any()):  # shrink mode: masked ranks' experts are absent; a masked rank sends nothing
            mask = self.mask.to(ids.device)
            valid &= mask[ids.clamp(min=0) // num_local] == 0
            if int(self.mask[self.rank]):
                valid &= False
        token, slot = valid.nonzero(as_tuple=True)
        e = ids[token, slot]
        return token, slot, e // num_local, e % num_local

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        state = (self._buffer_idx, self._dispatch_idx)  # shrink mode re-runs into the same result set
        return self.ep.run(lambda: self._dispatch(args), lambda: self._rewind(state))

    def _dispatch(self, args: DispatchArgs) -> DispatchResult:
        r, num_local, n, hidden = (
            self.num_ranks,
            args.num_local_experts,
            args.num_max_dispatch_tokens_per_rank,
            args.hidden,
        )
        x, idx, ws = args.x, self._flip(), self._ws
        ws.device = x.device
        lap = profiling.laps("dispatch")
        fmt = RowFormat(hidden, x.dtype, args.quant, args.topk_idx.shape[1], False, args.round_scale)
        token, slot, dest, expert = self._pairs(args.topk_idx, num_local)
        plan = make_plan(
            token, slot, dest, expert, num_tokens=x.shape[0], num_ranks=r, rank=self.rank,
            num_local_experts=num_local, per_pair_rows=False,
        )  # fmt: skip
        lap("layout")
        # the results live in two alternating sets (DeepEP: hold at most 2 results); reuse avoids page faults
        out = f"dispatch_out{self._dispatch_idx}_"
        self._dispatch_idx ^= 1
        recv_x = ws.get(out + "x", (num_local, r * n, hidden), fmt.data_dtype)
        scales = None
        if args.quant is not None:
            groups = hidden // 512 if args.use_ue8m0 else hidden // 128
            scale_dtype = torch.int32 if args.use_ue8m0 else torch.float32
            # DeepEP allocates [L, groups, R * N] and transposes: the token dimension has stride 1
            scales = ws.get(out + "scales", (num_local, groups, r * n), scale_dtype).transpose(1, 2)
        src_info = ws.get(out + "src_info", (num_local, r * n), torch.int32)
        layout_range = ws.get(out + "layout_range", (num_local, r), torch.int64)
        recv_count = ws.get(out + "recv_count", (num_local,), torch.int32)
        masked = Masked(
            self.rank, recv_x, scales, src_info, layout_range, recv_count, args.use_ue8m0,
            args.cumulative_local_expert_recv_stats, args.dispatch_wait_recv_cost_stats,
        )  # fmt: skip
        fingerprint = (n, args.num_experts, hidden, DTYPE_CODES[x.dtype], QUANTS.index(args.quant), fmt.row_bytes)
        job = DispatchJob(
            self.ep, "low_latency_dispatch", x, plan, fmt, None, None, fingerprint, masked, ws, tag=str(idx)
        )
        completion = start_dispatch(job)
        handle = make_handle(src_info, layout_range, n, hidden, args.num_experts)
        recv_out = recv_x if scales is None else (recv_x, scales)
        return DispatchResult(recv_out, recv_count, handle, completion)

    # ---- combine ----------------------------------------------------------------------------------------------
    def combine(self, args: CombineArgs) -> CombineResult:
        state, first = (self._buffer_idx, self._dispatch_idx), list[torch.Tensor]()

        def send() -> CombineResult:  # a shrink-mode re-run writes the tensor the first attempt returned
            res = self._combine(args if not first else dataclasses.replace(args, out=first[0]))
            first.append(res.combined_x)
            return res

        return self.ep.run(send, lambda: self._rewind(state))

    def _combine(self, args: CombineArgs) -> CombineResult:
        h, r, idx = args.handle, self.num_ranks, self._flip()
        num_local, n, hidden = h.layout_range.shape[0], h.num_max_dispatch_tokens_per_rank, h.hidden
        self._ws.device = args.x.device
        try:
            rows, rows_per_src = Masked.return_rows(h.layout_range, n, self.mask)
        except MoeDistributeError as err:
            self.abort("combine", err.code)
            raise
        token, slot, dest, expert = self._pairs(args.topk_idx, num_local)
        num_tokens = args.topk_idx.shape[0]
        plan = make_plan(
            token, slot, dest, expert, num_tokens=num_tokens, num_ranks=r, rank=self.rank,
            num_local_experts=num_local, per_pair_rows=True,
        )  # fmt: skip
        source = self._zero_copy_buffer(idx, h) if args.zero_copy else args.x
        out = (
            args.out
            if args.out is not None
            else torch.empty((num_tokens, hidden), dtype=source.dtype, device=source.device)
        )
        weights = args.topk_weights[plan.token, plan.slot]

        def on_wait(agreement, wait_ns: int) -> None:
            if args.combine_wait_recv_cost_stats is not None:
                args.combine_wait_recv_cost_stats += wait_ns

        job = CombineJob(
            self.ep, "low_latency_combine", source.view(num_local * r * n, hidden), rows, rows_per_src, plan, weights,
            ReturnFormat(hidden, source.dtype, False), num_tokens, out,
            (n, h.num_experts, hidden, DTYPE_CODES[args.x.dtype]), COMBINE_NAMES,
            ("handle", "the dispatch's handle and the same topk_idx"), self._ws, tag=str(idx), on_wait=on_wait,
        )  # fmt: skip
        return CombineResult(out, start_combine(job))

    def _zero_copy_buffer(self, idx: int, handle) -> torch.Tensor:
        num_local, r = handle.layout_range.shape
        shape_ = (num_local, r * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        self._ws.device = handle.src_info.device
        return self._ws.get(f"zero_copy{idx}", shape_, torch.bfloat16)

    def next_combine_buffer(self, handle) -> torch.Tensor:
        return self._zero_copy_buffer(self._buffer_idx, handle)

    def dispatch_flat(self, params: DispatchParams) -> Completion:
        return start_dispatch_flat(params, self.ep)

    def combine_flat(self, params: CombineParams) -> Completion:
        return start_combine_flat(params, self.ep)

    def clean(self) -> None:
        self._buffer_idx = 0

    def destroy(self) -> None:
        self._ws.clear()
