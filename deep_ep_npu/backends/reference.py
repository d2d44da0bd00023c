"""The reference backend: DeepEP's low-latency masked layout over ``torch.distributed`` on CPU tensors (gloo).

Device tensors (NCCL / HCCL groups) are refused with a clear error: the wire and result buffers live on the CPU.

Dispatch: a fixed-size header all-to-all (status, rows per destination, parameter fingerprint), then one uneven
``all_to_all_single`` of :class:`~.wire.RowFormat` rows: each token travels once per destination rank with a
bitmask of that rank's experts, and the receiver expands it into ``recv_x`` `[L, R * N, hidden]`. Inside local
expert i, source rank j owns rows ``[begin, begin + count)`` (this rank's own block first, then the other
sources in rank order; tokens ascending). Rows for this rank itself never touch the wire: they are expanded while
the remote rows are in flight.
Combine: a header carrying every rank's send and expect vectors (a handle or ``topk_idx`` that does not match
the dispatch is reported on every rank), then the rows go back, in exactly the order the source rank's own
``topk_idx`` predicts, and are reduced there in fp32. No Python loop touches tokens.

Buffers: the wire buffers (send/receive of both ops) are owned by the backend, grown on demand and double-buffered
like DeepEP's (index flipped by every dispatch and combine). Dispatch results (``recv_x``, scales, ``recv_count``,
the handle's tensors) live in two alternating sets, so a dispatch's results stay valid until the next-but-one
dispatch (DeepEP: do not hold more than 2 low-latency results); combine results are fresh tensors (or ``out``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import profiling
from ..event import Completion
from ..handle import LowLatencyHandle, make_handle
from ..ops import comm, moe_distribute_combine_setup, moe_distribute_dispatch_setup
from ..ops.errors import MoeDistributeError, invalid, shape
from ..ops.layout import make_send_plan
from .base import BufferConfig, CombineResult, DispatchResult, FlatPending, LowLatencyBackend
from .spec import CombineArgs, DispatchArgs
from .wire import RowFormat
from .workspace import Exchange, Workspace

_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_QUANTS = {None: 0, "fp8_e4m3": 1, "int8_per_token": 2}
_DISPATCH_FP = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype", "use_fp8 format", "row bytes")
_COMBINE_FP = ("num_max_dispatch_tokens_per_rank", "num_experts", "hidden", "x dtype")
_LOOP_BYTES = 1 << 22  # received data above which recv_x is filled by one gather per expert


def _exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


class ReferenceBackend(LowLatencyBackend):
    """DeepEP low-latency semantics on any torch.distributed group (see the module docstring)."""

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

    def _header(self, op: str, status: int, rows: list[int], pairs: list[int], fingerprint) -> comm.Header:
        return self._start_header(op, status, rows, pairs, fingerprint)()

    def _start_header(self, op: str, status: int, rows: list[int], pairs: list[int], fingerprint):
        """Start the header exchange; returns ``finish() -> Header`` (local work can overlap the round trip)."""
        # ranks removed by shrink mode read as "nothing to send or expect" (combine: the first 2R entries)
        neutral = (
            tuple(fingerprint)
            if op == "dispatch"
            else (0,) * (2 * self.num_ranks) + tuple(fingerprint[2 * self.num_ranks :])
        )
        return self.ep.start_header(status, rows, pairs, fingerprint, neutral, f"low_latency_{op}")

    def _rewind(self, state: tuple[int, int]) -> None:
        self._buffer_idx, self._dispatch_idx = state

    def check_device(self, tensor: torch.Tensor, param: str) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            raise invalid(
                param,
                f"is on {tensor.device}; the reference backend works on CPU tensors over gloo (move it to the CPU, "
                "or use backend='ascend' on an Ascend NPU)",
            )

    def abort(self, op: str, code: int) -> None:
        r = self.num_ranks
        width = len(_DISPATCH_FP) if op == "dispatch" else 2 * r + len(_COMBINE_FP)
        self._header(op, code, [0] * r, [0] * r, [0] * width)

    # ---- which pairs leave this rank ------------------------------------------------------------------------
    def _pairs(self, topk_idx: torch.Tensor, num_local: int):
        """(token, slot, dest rank, local expert) `[num_pairs]` int64 of the valid entries of ``topk_idx``."""
        ids = topk_idx.long()
        valid = ids >= 0
        if bool(self.mask.any()):  # shrink mode: masked ranks' experts are absent; a masked rank sends nothing
            valid &= self.mask[ids.clamp(min=0) // num_local] == 0
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
        x, idx = args.x, self._flip()
        lap = profiling.laps("dispatch")
        fmt = RowFormat(hidden, x.dtype, args.quant, num_local, args.round_scale)
        token, slot, dest, expert = self._pairs(args.topk_idx, num_local)
        plan = make_send_plan(
            token,
            slot,
            dest,
            expert,
            num_tokens=x.shape[0],
            world_size=r,
            max_local_experts=num_local,
            per_pair_rows=False,
        )
        fingerprint = (n, args.num_experts, hidden, _DTYPES[x.dtype], _QUANTS[args.quant], fmt.row_bytes)
        lap("layout")
        finish_header = self._start_header(
            "dispatch", comm.STATUS_OK, plan.rows_per_dest, plan.pairs_per_dest, fingerprint
        )
        profiling.record_wire(
            "dispatch", [k * fmt.row_bytes for k in plan.rows_per_dest], self.rank, 8 * (3 + len(fingerprint))
        )

        # rows for this rank itself never touch the wire: move them behind the others and expand them while the
        # all-to-all of the remote rows is in flight (their block comes first inside every expert)
        me, num_rows = self.rank, len(plan.row_token)
        row_dest = torch.repeat_interleave(torch.arange(r), torch.tensor(plan.rows_per_dest), output_size=num_rows)
        row_perm = torch.argsort(torch.where(row_dest == me, r, row_dest), stable=True)
        inv_perm = torch.empty_like(row_perm)
        inv_perm[row_perm] = torch.arange(num_rows)
        row_token = plan.row_token[row_perm]
        num_remote = num_rows - plan.rows_per_dest[me]
        send = self._ws.get(f"dispatch_send{idx}", (num_rows, fmt.row_bytes), torch.uint8)
        x_rows = torch.index_select(x, 0, row_token, out=self._ws.get("dispatch_rows", (num_rows, hidden), x.dtype))
        work = self._ws.get("dispatch_fp8", (num_rows, hidden), torch.float32) if args.quant == "fp8_e4m3" else None
        fmt.encode_into(send, x_rows, row_token, inv_perm[plan.row_of_pair], plan.expert, work)
        lap("packing")  # (while the header travels)
        header = finish_header()
        comm.check_header(header, self.rank, _DISPATCH_FP, "low_latency_dispatch")
        lap("header_wait")
        recv_rows = [0 if s == me else k for s, k in enumerate(header.rows)]
        send_rows = [0 if s == me else k for s, k in enumerate(plan.rows_per_dest)]
        recv = self._ws.get(f"dispatch_recv{idx}", (sum(recv_rows), fmt.row_bytes), torch.uint8)
        exchange = Exchange(self.ep, recv, send[:num_remote], recv_rows, send_rows)
        lap("collective_start")

        # the results live in two alternating sets (DeepEP: hold at most 2 results); reuse avoids page faults
        out = f"dispatch_out{self._dispatch_idx}_"
        self._dispatch_idx ^= 1
        recv_x = self._ws.get(out + "x", (num_local, r * n, hidden), fmt.data_dtype)
        scales = None
        if args.quant is not None:
            groups = hidden // 512 if args.use_ue8m0 else hidden // 128
            scale_dtype = torch.int32 if args.use_ue8m0 else torch.float32
            # DeepEP allocates [L, groups, R * N] and transposes: the token dimension has stride 1
            scales = self._ws.get(out + "scales", (num_local, groups, r * n), scale_dtype).transpose(1, 2)
        src_info = self._ws.get(out + "src_info", (num_local, r * n), torch.int32)
        layout_range = self._ws.get(out + "layout_range", (num_local, r), torch.int64)
        recv_count = self._ws.get(out + "recv_count", (num_local,), torch.int32)
        outputs = (recv_x, scales, src_info, args.use_ue8m0)
        self_rows = send[num_remote:]
        counts_self = self._expand(
            fmt, self_rows, torch.full((len(self_rows),), me), torch.zeros(num_local, dtype=torch.int64), outputs, n
        )
        lap("unpacking_self")

        def finish() -> None:
            lap = profiling.laps("dispatch")
            exchange.wait()
            lap("collective_wait")
            src_of_row = torch.repeat_interleave(torch.arange(r), torch.tensor(recv_rows), output_size=len(recv))
            counts = counts_self + self._expand(fmt, recv, src_of_row, counts_self.sum(dim=1), outputs, n)
            # blocks inside an expert: this rank's own first, then the other sources in rank order
            order = torch.tensor([me] + [s for s in range(r) if s != me])
            begin = torch.empty_like(counts)
            begin[:, order] = _exclusive_cumsum(counts[:, order], 1)
            layout_range.copy_((begin << 32) | counts)
            recv_count.copy_(counts.sum(dim=1))
            if args.cumulative_local_expert_recv_stats is not None:
                args.cumulative_local_expert_recv_stats += recv_count
            if args.dispatch_wait_recv_cost_stats is not None:
                args.dispatch_wait_recv_cost_stats += exchange.wait_ns
            lap("unpacking")

        handle = make_handle(src_info, layout_range, n, hidden, args.num_experts)
        recv_out = recv_x if scales is None else (recv_x, scales)
        return DispatchResult(recv_out, recv_count, handle, Completion(finish))

    def _expand(
        self, fmt: RowFormat, rows: torch.Tensor, src_of_row: torch.Tensor, base: torch.Tensor, outputs, n: int
    ):
        """Expand received ``rows`` `[k, row_bytes]` (sources ``src_of_row`` `[k]`, ascending) into ``recv_x`` and
        friends, expert i's rows starting at position ``base[i]``. Returns `[L, R]` int64 rows per (expert, source)."""
        recv_x, scales, src_info, use_ue8m0 = outputs
        num_local, r = recv_x.shape[0], self.num_ranks
        bits = fmt.expert_bits(rows)
        if bool(self.mask.any()):
            bits &= (self.mask[src_of_row] == 0).unsqueeze(1)
        row, local = bits.nonzero(as_tuple=True)  # row-major: (source, token) ascending, then expert
        src = src_of_row[row]
        order = torch.argsort(local * r + src, stable=True)
        row, local, src = row[order], local[order], src[order]
        counts = torch.bincount(local * r + src, minlength=num_local * r).view(num_local, r)
        per_expert = counts.sum(dim=1)
        pos = torch.arange(row.numel()) - _exclusive_cumsum(per_expert)[local] + base[local]
        flat = local * (r * n) + pos
        if row.numel() == 0:
            return counts
        if row.numel() * fmt.data_bytes < _LOOP_BYTES:  # small: one scatter beats a call per expert
            fmt.scatter_data(rows, row, recv_x.view(num_local * r * n, -1), flat)
        else:  # large: expert i's rows are one contiguous range of its block, gathered in one pass each
            begin = 0
            for i, (count, b) in enumerate(zip(per_expert.tolist(), base.tolist(), strict=True)):
                if count:
                    fmt.gather_data(rows, row[begin : begin + count], recv_x[i, b : b + count])
                begin += count
        if scales is not None:
            scales[local, pos] = fmt.scales(rows, row, use_ue8m0)
        src_info.view(-1)[flat] = fmt.tokens(rows)[row]
        return counts

    # ---- combine ----------------------------------------------------------------------------------------------
    def _return_rows(self, handle: LowLatencyHandle) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``x`` `[L * R * N]` to send back, ordered by (source rank, expert, row), and rows per source."""
        num_local, r = handle.layout_range.shape
        n = handle.num_max_dispatch_tokens_per_rank
        count, begin = handle.recv_count_per_rank, handle.recv_begin
        if bool(((count < 0) | (begin < 0) | (begin + count > r * n)).any()):
            raise shape("handle.layout_range", f"holds a block outside [0, R * N = {r * n}); pass dispatch's handle")
        if bool(self.mask.any()):  # nothing goes back to masked ranks (e.g. one that failed after the dispatch)
            count = count.masked_fill(self.mask.bool().unsqueeze(0), 0)
        count_t = count.t().reshape(-1)
        start_t = (begin + torch.arange(num_local).unsqueeze(1) * (r * n)).t().reshape(-1)
        total = int(count_t.sum())
        rows = torch.repeat_interleave(start_t - _exclusive_cumsum(count_t), count_t, output_size=total)
        return rows + torch.arange(total), count.sum(dim=0).tolist()

    def combine(self, args: CombineArgs) -> CombineResult:
        state, first = (self._buffer_idx, self._dispatch_idx), []

        def send() -> CombineResult:  # a shrink-mode re-run writes the tensor the first attempt returned
            res = self._combine(args if not first else dataclasses.replace(args, out=first[0]))
            first.append(res.combined_x)
            return res

        return self.ep.run(send, lambda: self._rewind(state))

    def _combine(self, args: CombineArgs) -> CombineResult:
        h, r, idx = args.handle, self.num_ranks, self._flip()
        lap = profiling.laps("combine")
        num_local, n, hidden = h.layout_range.shape[0], h.num_max_dispatch_tokens_per_rank, h.hidden
        try:
            rows, rows_per_src = self._return_rows(h)
        except MoeDistributeError as err:
            self.abort("combine", err.code)
            raise
        token, slot, dest, expert = self._pairs(args.topk_idx, num_local)
        order = torch.argsort((dest * num_local + expert) * max(args.topk_idx.shape[0], 1) + token)
        token, slot, dest = token[order], slot[order], dest[order]
        pairs_per_dest = torch.bincount(dest, minlength=r).tolist()
        fingerprint = (*rows_per_src, *pairs_per_dest, n, h.num_experts, hidden, _DTYPES[args.x.dtype])
        lap("layout")
        finish_header = self._start_header("combine", comm.STATUS_OK, rows_per_src, pairs_per_dest, fingerprint)
        profiling.record_wire(
            "combine",
            [k * hidden * args.x.dtype.itemsize for k in rows_per_src],
            self.rank,
            8 * (3 + len(fingerprint)),
        )

        source = self._zero_copy_buffer(idx, h) if args.zero_copy else args.x
        flat_source = source.view(num_local * r * n, hidden)
        # this rank's own rows are reduced locally while the remote rows travel (they never touch the wire)
        me = self.rank
        row_lo = sum(rows_per_src[:me])
        row_hi = row_lo + rows_per_src[me]
        pair_lo = sum(pairs_per_dest[:me])
        pair_hi = pair_lo + pairs_per_dest[me]
        remote_rows = torch.cat([rows[:row_lo], rows[row_hi:]])
        send = self._ws.get(f"combine_send{idx}", (remote_rows.numel(), hidden), source.dtype)
        torch.index_select(flat_source, 0, remote_rows, out=send)
        lap("packing")  # (while the header travels)

        header = finish_header()
        comm.check_header(header, self.rank, (), "low_latency_combine")
        sends = [fp[:r] for fp in header.fingerprint]
        expects = [fp[r : 2 * r] for fp in header.fingerprint]
        bad = [(p, q) for p in range(r) for q in range(r) if sends[p][q] != expects[q][p]]
        if bad:
            p, q = bad[0]
            raise shape(
                "handle",
                f"rank {p} would return {sends[p][q]} rows to rank {q}, whose topk_idx routes {expects[q][p]} tokens "
                f"to it; pass the dispatch's handle and the same topk_idx (mismatched rank pairs: {bad[:8]})",
            )
        header.fingerprint = [fp[2 * r :] for fp in header.fingerprint]
        comm.check_header(header, self.rank, _COMBINE_FP, "low_latency_combine")
        lap("header_wait")
        recv_rows = [0 if s == me else k for s, k in enumerate(header.rows)]
        send_rows = [0 if s == me else k for s, k in enumerate(rows_per_src)]
        recv = self._ws.get(f"combine_recv{idx}", (sum(recv_rows), hidden), source.dtype)
        row_bytes = hidden * source.dtype.itemsize
        exchange = Exchange(
            self.ep,
            recv.view(torch.uint8).view(-1, row_bytes),
            send.view(torch.uint8).view(-1, row_bytes),
            recv_rows,
            send_rows,
        )
        lap("collective_start")
        num_tokens = args.topk_idx.shape[0]
        out = args.out if args.out is not None else torch.empty((num_tokens, hidden), dtype=source.dtype)
        acc = self._ws.get(f"combine_acc{idx}", (num_tokens, hidden), torch.float32).zero_()
        weights = args.topk_weights[token, slot].unsqueeze(1)
        self_rows = torch.index_select(flat_source, 0, rows[row_lo:row_hi])
        self._accumulate(acc, self_rows, token[pair_lo:pair_hi], weights[pair_lo:pair_hi])
        lap("unpacking_self")
        remote_token = torch.cat([token[:pair_lo], token[pair_hi:]])
        remote_weights = torch.cat([weights[:pair_lo], weights[pair_hi:]])

        def finish() -> None:
            lap = profiling.laps("combine")
            exchange.wait()
            lap("collective_wait")
            self._accumulate(acc, recv, remote_token, remote_weights)
            out.copy_(acc)
            if args.combine_wait_recv_cost_stats is not None:
                args.combine_wait_recv_cost_stats += exchange.wait_ns
            lap("unpacking")

        return CombineResult(out, Completion(finish))

    def _accumulate(self, acc: torch.Tensor, y: torch.Tensor, token: torch.Tensor, weights: torch.Tensor) -> None:
        """``acc[token[i]] += weights[i] * y[i]`` in fp32 (``y`` `[k, hidden]`, weights `[k, 1]` fp32)."""
        if token.numel() == 0:
            return
        # (``y`` is a scratch tensor: converted or scaled in place; a mixed-dtype mul would be slower)
        acc.index_add_(0, token, y.float().mul_(weights))

    def _zero_copy_buffer(self, idx: int, handle: LowLatencyHandle) -> torch.Tensor:
        num_local, r = handle.layout_range.shape
        shape_ = (num_local, r * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        return self._ws.get(f"zero_copy{idx}", shape_, torch.bfloat16)

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self._zero_copy_buffer(self._buffer_idx, handle)

    # ---- the Ascend flat layout, through the ops layer --------------------------------------------------------
    def dispatch_flat(self, x: torch.Tensor, expert_ids: torch.Tensor, **op_kwargs) -> FlatPending:
        return _OpsPending(
            moe_distribute_dispatch_setup(x, expert_ids, self.group, self.num_ranks, self.rank, **op_kwargs)
        )

    def combine_flat(self, expand_x: torch.Tensor, expert_ids: torch.Tensor, *args, **op_kwargs) -> FlatPending:
        assist, counts, weights, num_experts = args
        handle = moe_distribute_combine_setup(
            expand_x,
            expert_ids,
            assist,
            counts,
            weights,
            self.group,
            self.num_ranks,
            self.rank,
            num_experts,
            **op_kwargs,
        )
        return _OpsPending(handle)

    def clean(self) -> None:
        self._buffer_idx = 0

    def destroy(self) -> None:
        self._ws.clear()


class _OpsPending(FlatPending):
    def __init__(self, handle) -> None:
        self._handle = handle

    def teardown(self):
        return self._handle.teardown()
