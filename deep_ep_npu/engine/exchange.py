"""The engine: one dispatch and one combine for every layout (:mod:`.masked`, :mod:`.flat`, :mod:`.expand`) and
transport; :class:`Engine` is the ``reference`` backend. The transport sends each rank its rows and a header (row
count, row size, the fingerprint every rank must agree on) while this rank places its own; the receive checks the
headers (a rejection or a disagreement raises the same error on every rank) and the layout places the rows. Combine
is the same in reverse (:mod:`.reduce`). :class:`~deep_ep_npu.backends.InFlight` is the one in-flight object
(hooks, events, ``*_start`` ops, ``comm_cmd_info`` wrap it)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import kernels, profiling
from ..backends import Backend, InFlight
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
from ..errors import MoeDistributeError, invalid, shape
from ..transports import Transport, create, static
from ..transports.agreement import STATUS_OK, Agreement, Send, TransportError, WindowTooSmall
from ..transports.early import early_bytes
from ..transports.group import EPGroup
from . import Layout, expand, flat, masked, pipeline
from .pool import ResultPool
from .reduce import CombineJob, reduce_own, reduce_remote
from .reduce import check as check_returns
from .rows import Parts, encoder
from .tp import tp_agree

FINGERPRINT = 16  # header words every layout may fill with what the ranks must agree on


def check_status(agreement: Agreement) -> None:
    """Raise the same error on every rank if any rank rejected its input."""
    if bad := [(r, s) for r, s in enumerate(agreement.status) if s != STATUS_OK]:
        ranks = ", ".join(f"rank {r} (aclnn {s})" for r, s in bad)
        raise MoeDistributeError(bad[0][1], "inputs", f"{agreement.op} aborted on every rank: rejected on {ranks}")


def named(err: TransportError) -> MoeDistributeError:
    """A transport's error, naming the parameter that fixes it."""
    if isinstance(err, WindowTooSmall):
        return invalid("num_rdma_bytes", f"{err}; pass num_rdma_bytes >= {err.need} (shared-memory window)")
    why = "every rank must pass the handle of the same dispatch, or none"
    return MoeDistributeError(err.code, "handle", f"{err}; {why}")


def check_names(agreement: Agreement, ep: EPGroup, names: Sequence[str], offset: int) -> None:
    """Raise the same error on every rank if the live ranks disagree on one of ``names`` (``shared[offset + i]``
    is ``names[i]``)."""
    for i, name in enumerate(names):
        values = [fp[offset + i] for fp in agreement.shared]
        if any(values[r] != values[ep.rank] for r in ep.live):
            msg = f"{agreement.op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks"
            raise shape(name, msg)


class Engine(Backend):
    """The reference backend: DeepEP's, DeepEP V2's and the Ascend ops' semantics on any torch.distributed group and
    device (every tensor it makes lives on the input's device). A buffer's engine: one host's shared-memory window
    when possible, reused double-buffered tensors as DeepEP's; ``reuse=False``: the ops' engine of a group
    (collective, its own tensors per call: any number in flight)."""

    name = "reference"

    def __init__(self, group: dist.ProcessGroup, **options: Any) -> None:
        super().__init__(group, **options)
        self.collective, self.window = create(self.ep, self.transport_name, self.num_rdma_bytes, self.reuse)
        self.early_bytes = early_bytes(self.ep.num_ranks, self.ep.device)  # (an early payload's bound)
        self.device, self._reused = torch.device("cpu"), dict[str, torch.Tensor]()  # (the call's input's device)
        self.results = ResultPool()
        self.tag, self.result_set = 0, 0  # which wire scratch / dispatch result set the next call uses
        self.wire: dict[str, tuple[list[int], int]] = {}  # the last call's bytes per destination, header bytes

    @property
    def transport(self) -> Transport:
        """The buffer's transport: its window when it has one, else the collective one."""
        return self.window or self.collective

    def transport_for(self, device: torch.device, tp: bool = False) -> Transport:
        """The window for CPU tensors without a TP stage (when the group has one), else the collective one."""
        return self.window if self.window is not None and device.type == "cpu" and not tp else self.collective

    def reused(self, name: str, shape_: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of the buffer's reused byte buffer ``name``, grown when a call needs more (dispatch results
        alternate between two sets)."""
        nbytes, buf = math.prod(shape_) * dtype.itemsize, self._reused.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != self.device:
            buf = self._reused[name] = torch.empty((max(nbytes, 1),), dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(dtype).view(shape_)

    def fresh(self, shape_: tuple[int, ...], dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        """A new tensor for a call's result on the call's device (``zeros``: zero-filled; :class:`ResultPool`)."""
        return self.results.take(shape_, dtype, self.device, zeros)

    def scratch(self, name: str, shape_: tuple[int, ...], dtype: torch.dtype, job: int = 0) -> torch.Tensor:
        """A buffer's reused tensor of this call's set (two alternate: at most two calls in flight; ``job``: of a
        combine's later jobs); the ops' engine gives each call its own (any number in flight)."""
        if not self.reuse:
            return torch.empty(shape_, dtype=dtype, device=self.device)
        return self.reused(f"{name}{self.tag}" if not job else f"{name}{self.tag}.{job}", shape_, dtype)

    def reject(self, op: str, code: int, tp: EPGroup | None = None) -> None:
        width = 1 + 2 * self.num_ranks + FINGERPRINT  # (:func:`header`'s words)
        if tp is None and static.reject(self.collective, op, code):  # (peers on the static round, exact receives)
            return
        if tp is not None:  # (the TP stage's call runs on the collective transport, its agreement first)
            self.collective.reject(op, code, width, staged=True)
        else:
            self.transport_for(torch.device("cpu")).reject(op, code, width)
        if tp is not None and tp.num_ranks == 2:
            tp_agree(tp, code, op)

    def _run(self, start: Callable[[], InFlight]) -> InFlight:
        """``start()`` (a send phase; its InFlight the receive). In shrink mode a rank failure in either phase shrinks
        the group, rewinds the buffer indices (so a re-run writes the same result tensors) and runs it again."""
        if not self.ep.enable_shrink:
            return start()
        state = (self.tag, self.result_set)

        def rewind() -> None:
            self.tag, self.result_set = state

        first = [self.ep.retry(start, rewind)]
        attempt = lambda: (first.pop() if first else self.ep.retry(start, rewind)).wait()  # noqa: E731
        return InFlight(lambda: self.ep.retry(attempt, rewind), first[0].value)

    def dispatch(self, call: DispatchCall) -> InFlight:
        return self._run(lambda: self._dispatch(call))

    def _begin(self, c: DispatchCall | CombineCall) -> contextlib.AbstractContextManager[None]:
        """A call's layout is made for the next set of tensors; it checks the call against a handle / capacity: a
        rejection is told to the peers."""
        self.tag ^= 1
        self.device = c.x.device
        return self.rejecting(c.op, tp=c.experts.tp)

    def _dispatch(self, c: DispatchCall) -> InFlight:
        layout: Layout
        with self._begin(c):
            if isinstance(c, MaskedDispatch):
                layout = masked.layout(c, self)
            elif isinstance(c, FlatDispatch):
                layout = flat.layout(c, self)
            else:
                layout = expand.layout(c, self)
        return InFlight(self._exchange(c.op, DispatchRound(self, layout)), layout.result())

    def combine(self, call: CombineCall) -> InFlight:
        first: list[torch.Tensor] = []  # a shrink-mode re-run writes the tensor the first attempt returned

        def start() -> InFlight:
            again = call
            if first and isinstance(call, MaskedCombine | FlatCombine):
                again = dataclasses.replace(call, out=first[0])
            inflight = self._combine(again)
            first.append(inflight.value)
            return inflight

        return self._run(start)

    def _combine(self, c: CombineCall) -> InFlight:
        with self._begin(c):
            if isinstance(c, MaskedCombine):
                jobs = masked.combine_jobs(c, self)
            elif isinstance(c, FlatCombine):
                jobs = flat.combine_jobs(c, self)
            else:
                jobs = expand.combine_jobs(c, self)
        last = len(jobs) - 1  # (a peer's rejection stops the next: only the last job starts before its agreement)
        receives = [self._exchange(c.op, CombineRound(self, job, i, i == last)) for i, job in enumerate(jobs)]
        outs = [out for job in jobs for out in (job.out, *(rider.out for rider in job.riders))]
        value = outs[0] if len(outs) == 1 else tuple(outs)
        return InFlight(lambda: [receive() for receive in receives] and value, value)

    def _exchange(self, op: str, round_: DispatchRound | CombineRound) -> Callable[[], object]:
        """One exchange of ``round_`` (a dispatch or a combine job): send (its ``write(remote, d, out)``: the rows for
        rank d; a TP pair's peer is told when the EP call fails before their agreement), check the headers (status,
        the round's ``check``, the fingerprint), run its ``own()`` while the rows travel, and return the receive: its
        ``finish(agreement, parts, wait_ns)``, timed when :data:`deep_ep_npu.profiling.enabled`."""
        started, sender, r = time.perf_counter(), round_.sender, self.num_ranks
        tp, device = sender.tp, sender.source.device
        transport = self.transport_for(device, tp is not None)
        shared = header(round_.row_bytes, round_.vectors, sender.fingerprint, r)
        self.wire[round_.kind] = ([n * shared[0] for n, _ in round_.counts], 8 * len(shared))  # (wire_stats)

        def check(agreement: Agreement) -> None:
            check_status(agreement)
            round_.check(agreement)
            check_names(agreement, self.ep, sender.names, 1 + 2 * r)
            check_names(agreement, self.ep, ("row size in bytes",), 0)  # (known to match before any row is read)

        write_rows = functools.partial(round_.write, transport is self.window)
        before = None if tp is None else tp.before_payload
        try:
            ticket = transport.send(
                Send(op, round_.counts, shared, write_rows, check, sender.agree_now, before, device)
            )
        except (MoeDistributeError, TransportError) as err:
            if tp is not None:
                tp.abort(err.code)
            if isinstance(err, TransportError):
                raise named(err) from err
            raise
        round_.own()
        send_s = time.perf_counter() - started

        def receive() -> object:
            called = time.perf_counter()
            try:
                got = ticket.receive()
            except TransportError as err:
                raise named(err) from err
            received = time.perf_counter()
            try:
                return round_.finish(got.agreement, got.parts, got.wait_ns)
            finally:
                ticket.done()
                if profiling.enabled:
                    times = dict(send=send_s, wait=received - called, place=time.perf_counter() - received)
                    profiling.add(round_.kind, **times)

        return receive

    def next_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The `[L, R * N, hidden]` bfloat16 buffer the next ``zero_copy`` combine of ``handle``'s layout reads."""
        self.device = handle.src_info.device
        return self.reused(f"zero_copy{self.tag ^ 1}", (*handle.src_info.shape, handle.hidden), torch.bfloat16)

    def can_fuse(self, call: FusedCall, ffn: FFN) -> bool:
        """No: the engine runs the pipeline (:mod:`.pipeline`)."""
        return False

    def mega_moe(self, call: FusedCall, ffn: FFN, fused: bool) -> torch.Tensor:
        return pipeline.run(self, call, ffn)

    def clean(self) -> None:
        self.tag = self.result_set = 0

    def destroy(self) -> None:
        if self.window is not None:
            self.window.close()
        self.collective.close()
        self._reused.clear()
        self.results.blocks.clear()


class DispatchRound:
    """One dispatch's exchange of ``layout`` (:class:`.Layout`): ``write`` encodes the rows for a rank (then the
    layout's ``fields``), ``own`` places this rank's own rows while the others travel (the layout's ``place_own``
    where it has one), ``finish`` places the received ones and returns the layout's result."""

    kind = "dispatch"

    def __init__(self, engine: Engine, layout: Layout) -> None:
        plan, fmt, me = layout.plan, layout.fmt, engine.rank
        self.sender, self.me, self.row_bytes, self.vectors = layout, me, fmt.row_bytes, layout.vectors
        self.encode = encoder(fmt, layout.source, plan, layout.weights, layout.smooth)
        self.own_rows = engine.scratch("dispatch_own", (plan.rows_per_dest[me], fmt.row_bytes), torch.uint8)
        known = layout.known or [-1] * engine.num_ranks
        self.counts = [[n, k] for n, k in zip(plan.rows_per_dest, known, strict=True)]

    def write(self, remote: bool, d: int, out: torch.Tensor) -> None:
        self.encode(remote, d, out)
        if (fields := getattr(self.sender, "fields", None)) is not None:  # (the row bytes past the source's)
            fields(d, out)

    def check(self, agreement: Agreement) -> None:
        if (check := getattr(self.sender, "check", None)) is not None:
            check(agreement)

    def own(self) -> None:
        encode_own = functools.partial(self.write, False, self.me, self.own_rows)
        if (place_own := getattr(self.sender, "place_own", None)) is None:
            return encode_own()
        return place_own(self.own_rows, encode_own)

    def finish(self, agreement: Agreement, parts: Parts, wait_ns: int) -> object:
        self.sender.place(parts, (self.me, self.own_rows), agreement, wait_ns)
        return self.sender.result()


class CombineRound:
    """The exchange of combine job ``i`` (its riders' rows in its wire rows, columns after its own): ``write`` sends
    each source its rows back, ``own`` reduces this rank's own rows while the others travel (unless the TP stage
    changes the source first or the handle is inconsistent: ``check`` raises), ``finish`` reduces the received ones."""

    kind = "combine"

    def __init__(self, engine: Engine, job: CombineJob, i: int, last: bool) -> None:
        self.sender, self.group, self.ep = job, [job, *job.riders], engine.ep
        r, me, plan = engine.num_ranks, engine.rank, job.plan
        self.starts = [sum(job.rows_per_src[:q]) for q in range(r)]
        ends = [sum(j.fmt.row_bytes for j in self.group[: k + 1]) for k in range(len(self.group))]
        self.columns = [slice(end - j.fmt.row_bytes, end) for j, end in zip(self.group, ends, strict=True)]
        self.row_bytes, self.vectors = ends[-1], (*job.rows_per_src, *plan.pairs_per_dest)
        self.early = job.tp is None and job.rows_per_src[me] == plan.pairs_per_dest[me]
        self.scratches = [functools.partial(engine.scratch, job=i + 100 * k) for k in range(len(self.group))]
        # the rows each source returns are known (the handle): the payload starts before the agreement (see
        # transports.early), when every agreeing rank's rows fit the bound, the same on every rank (``capacity``)
        known = last and job.tp is None and 0 < job.capacity * ends[-1] <= engine.early_bytes
        self.counts = [[n, k if known else -1] for n, k in zip(job.rows_per_src, plan.pairs_per_dest, strict=True)]

    def write(self, remote: bool, q: int, out: torch.Tensor) -> None:
        for j, cols in zip(self.group, self.columns, strict=True):
            rows, dst, fmt = j.return_rows[self.starts[q] : self.starts[q] + j.rows_per_src[q]], out[:, cols], j.fmt
            if fmt.quantized:
                fmt.encode(j.source.index_select(0, rows), dst)
            elif not remote or not kernels.gather(j.source, rows, dst.view(fmt.dtype)):
                torch.index_select(j.source, 0, rows, out=dst.view(fmt.dtype))

    def check(self, agreement: Agreement) -> None:
        check_returns(self.sender, self.ep, agreement)

    def own(self) -> None:
        for j, scratch in zip(self.group, self.scratches, strict=True) if self.early else ():
            reduce_own(j, scratch)

    def finish(self, agreement: Agreement, parts: Parts, wait_ns: int) -> object:
        for j, scratch, cols in zip(self.group, self.scratches, self.columns, strict=True):
            reduce_remote(j, scratch, agreement, [(q, p[:, cols]) for q, p in parts], wait_ns)
        return None


def header(row_bytes: int, vectors: Sequence[int], fingerprint: Sequence[int], num_ranks: int) -> list[int]:
    """The shared header words of a call: the row size, up to 2R words of vectors, up to :data:`FINGERPRINT` words of
    fingerprint, each part zero-padded."""
    assert len(vectors) <= 2 * num_ranks and len(fingerprint) <= FINGERPRINT, "the layout's header words fit"
    pad = [0] * (2 * num_ranks - len(vectors)) + list(fingerprint) + [0] * (FINGERPRINT - len(fingerprint))
    return [row_bytes, *vectors, *pad]


_ENGINES: dict[int, Engine] = {}


def engine_for(group: dist.ProcessGroup) -> Engine:
    """The ops' engine of ``group`` (collective, no shrink, the default timeout), one per group per process."""
    eng = _ENGINES.get(id(group))
    if eng is None or eng.group is not group:
        eng = _ENGINES[id(group)] = Engine(group, reuse=False)
    return eng
