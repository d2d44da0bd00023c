"""The reference backend: DeepEP's low-latency calls on the engine (:mod:`deep_ep_npu.engine`), masked layout.

Works on any torch.distributed group and device (gloo on CPU, NCCL on CUDA, HCCL on NPU tensors): every buffer
lives on the input's device. Dispatch sends each token once per destination rank with the local experts it is for
and expands it into ``recv_x`` `[L, R * N, hidden]`; inside local expert i, source rank j owns rows
``[begin, begin + count)`` (this rank's own block first, then the other sources in rank order; tokens ascending).
Combine returns the rows in the order the source's ``topk_idx`` predicts and reduces them there in fp32. The wire
buffers (the backend's, grown on demand) are double-buffered like DeepEP's; dispatch results (``recv_x``, scales,
``recv_count``, the handle's tensors) live in two alternating sets, valid until the next-but-one dispatch (DeepEP:
hold at most 2 low-latency results); combine results are fresh tensors (or ``out``).
"""

import dataclasses

import torch

from .. import profiling
from ..engine import flat
from ..engine.combine import CombineJob
from ..engine.dispatch import DispatchJob
from ..engine.flat import start_combine_flat, start_dispatch_flat
from ..engine.layouts import Masked
from ..engine.plan import plan_topk
from ..engine.rows import LOGFMT, QUANTS, ReturnFormat, RowFormat
from ..engine.transport import create_transport
from ..errors import MoeDistributeError
from ..event import Completion
from ..group import DTYPE_CODES
from ..handle import make_handle
from ..ll_params import CombineArgs, DispatchArgs
from ..params import CombineParams, DispatchParams
from . import CombineResult, DispatchResult, LowLatencyBackend

COMBINE_NAMES = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype")


class ReferenceBackend(LowLatencyBackend):
    """DeepEP low-latency semantics on the engine (see the module docstring)."""

    name = "reference"
    _dispatch_idx = 0  # dispatch results: flips on every dispatch (wire buffers: ``_flip()``)

    def __init__(self, group, config) -> None:
        super().__init__(group, config)
        self.transport = create_transport(self.ep, config.transport, config.num_rdma_bytes)  # collective

    def _rewind(self, state: tuple[int, int]) -> None:
        self._buffer_idx, self._dispatch_idx = state

    def abort(self, op: str, code: int) -> None:
        if op in ("dispatch_flat", "combine_flat"):
            name = DispatchParams.op if op == "dispatch_flat" else flat.COMBINE_OP
            return self.transport.reject(name, code, *flat.agreement_widths(name, self.num_ranks))
        d = op == "dispatch"  # the agreement rows of dispatch and combine
        width = len(Masked.names) if d else 2 * self.num_ranks + len(COMBINE_NAMES)
        self.transport.reject(f"low_latency_{op}", code, 2 if d else 0, width)

    def _plan(self, topk_idx: torch.Tensor, num_local: int, per_pair_rows: bool):
        """The engine's plan of ``topk_idx`` (shrink mode: masked ranks' experts are absent, a masked rank sends
        nothing)."""
        return plan_topk(topk_idx, num_local_experts=num_local, num_ranks=self.num_ranks, rank=self.rank,
                         mask=self.mask, per_pair_rows=per_pair_rows)  # fmt: skip

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        state = (self._buffer_idx, self._dispatch_idx)  # shrink mode re-runs into the same result set
        return self.ep.run(lambda: self._dispatch(args), lambda: self._rewind(state))

    def _dispatch(self, args: DispatchArgs) -> DispatchResult:
        r, num_local = self.num_ranks, args.num_local_experts
        n, hidden = args.num_max_dispatch_tokens_per_rank, args.hidden
        x, idx, ws = args.x, self._flip(), self._ws
        ws.device = x.device
        lap = profiling.laps("dispatch")
        fmt = RowFormat(hidden, x.dtype, args.quant, args.topk_idx.shape[1], False, args.round_scale)
        plan = self._plan(args.topk_idx, num_local, False)
        lap("layout")
        # the two alternating result sets are reused: no page faults
        out = f"dispatch_out{self._dispatch_idx}_"
        self._dispatch_idx ^= 1
        recv_x = ws.get(out + "x", (num_local, r * n, hidden), fmt.data_dtype)
        scales = None
        if args.quant is not None:  # DeepEP allocates [L, groups, R * N] and transposes: tokens have stride 1
            groups, scale_dtype = (hidden // 512, torch.int32) if args.use_ue8m0 else (hidden // 128, torch.float32)
            scales = ws.get(out + "scales", (num_local, groups, r * n), scale_dtype).transpose(1, 2)
        src_info = ws.get(out + "src_info", (num_local, r * n), torch.int32)
        layout_range = ws.get(out + "layout_range", (num_local, r), torch.int64)
        recv_count = ws.get(out + "recv_count", (num_local,), torch.int32)
        masked = Masked(self.rank, recv_x, scales, src_info, layout_range, recv_count, args.use_ue8m0,
                        args.cumulative_local_expert_recv_stats, args.dispatch_wait_recv_cost_stats)  # fmt: skip
        fingerprint = (n, args.num_experts, hidden, DTYPE_CODES[x.dtype], QUANTS.index(args.quant), fmt.row_bytes)
        job = DispatchJob(self.ep, "low_latency_dispatch", x, plan, fmt, None, None, fingerprint, masked, ws,
                          tag=str(idx), defer_payload=True)  # fmt: skip
        completion = self.transport.dispatch(job)
        handle = make_handle(src_info, layout_range, n, hidden, args.num_experts)
        return DispatchResult(recv_x if scales is None else (recv_x, scales), recv_count, handle, completion)

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
            rows, rows_per_src = Masked.return_rows(h, self.mask)
        except MoeDistributeError as err:
            self.abort("combine", err.code)
            raise
        num_tokens, plan = args.topk_idx.shape[0], self._plan(args.topk_idx, num_local, True)
        source = self._zero_copy_buffer(idx, h) if args.zero_copy else args.x
        out = args.out if args.out is not None else source.new_empty((num_tokens, hidden))
        weights, stats = args.topk_weights[plan.token, plan.slot], args.combine_wait_recv_cost_stats
        on_wait = None if stats is None else (lambda agreement, wait_ns: stats.add_(wait_ns))
        job = CombineJob(
            self.ep, "low_latency_combine", source.view(num_local * r * n, hidden), rows, rows_per_src, plan, weights,
            ReturnFormat(hidden, source.dtype, LOGFMT if args.use_logfmt else 0), num_tokens, out,
            (n, h.num_experts, hidden, DTYPE_CODES[args.x.dtype]), COMBINE_NAMES,
            ("handle", "the dispatch's handle and the same topk_idx"), self._ws, tag=str(idx), on_wait=on_wait,
            defer_payload=True,
        )  # fmt: skip
        return CombineResult(out, self.transport.combine(job))

    def dispatch_flat(self, params: DispatchParams) -> Completion:
        return start_dispatch_flat(params, self.ep, transport=self.transport)

    def combine_flat(self, params: CombineParams) -> Completion:
        return start_combine_flat(params, self.ep, transport=self.transport)

    def clean(self) -> None:
        self._buffer_idx = 0

    def destroy(self) -> None:
        self.transport.close()
        super().destroy()
