"""The engine: one dispatch and one combine for every layout (:mod:`.masked`, :mod:`.flat`, :mod:`.expand`) and
transport; :class:`Engine` is the ``reference`` backend. The transport sends each rank its rows and a header (row
count, row size, the fingerprint every rank must agree on) while this rank places its own; the receive checks the
headers (a rejection or a disagreement raises the same error on every rank) and the layout places the rows. Combine
is the same in reverse (:mod:`.reduce`). :class:`~deep_ep_npu.backends.InFlight` is the one in-flight object
(hooks, events, ``*_start`` ops, ``comm_cmd_info`` wrap it)."""

from __future__ import annotations

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
from ..core.call import FFN, CombineCall, DispatchCall
from ..errors import MoeDistributeError, shape
from ..transports import Check, Transport, create, static
from ..transports.agreement import STATUS_OK, Agreement
from ..transports.collective import EPGroup
from ..transports.early import early_bytes
from . import Layout, expand, flat, masked, pipeline, reduce
from .rows import Parts, encoder
from .tp import tp_agree

FINGERPRINT = 16  # header words every layout may fill with what the ranks must agree on


def check_status(agreement: Agreement) -> None:
    """Raise the same error on every rank if any rank rejected its input."""
    if bad := [(r, s) for r, s in enumerate(agreement.status) if s != STATUS_OK]:
        ranks = ", ".join(f"rank {r} (aclnn {s})" for r, s in bad)
        raise MoeDistributeError(bad[0][1], "inputs", f"{agreement.op} aborted on every rank: rejected on {ranks}")


def check_names(agreement: Agreement, ep: EPGroup, names: Sequence[str], offset: int) -> None:
    """Raise the same error on every rank if the live ranks disagree on one of ``names`` (``shared[offset + i]``
    is ``names[i]``)."""
    for i, name in enumerate(names):
        values = [fp[offset + i] for fp in agreement.shared]
        if any(values[r] != values[ep.rank] for r in ep.live):
            msg = f"{agreement.op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks"
            raise shape(name, msg)


class ResultPool:
    """New tensors for calls' results (:meth:`take`): a CPU result of :attr:`min_bytes` or more reuses the memory of
    an earlier one whose every tensor and view is gone (a caching allocator, as a GPU's: a fresh page costs a page
    fault, more than the copy that fills it); at most :attr:`max_blocks` blocks are kept."""

    min_bytes, max_blocks = 1 << 20, 8

    def __init__(self) -> None:
        self.blocks: list[torch.UntypedStorage] = []

    def take(self, shape_: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeros: bool) -> torch.Tensor:
        nbytes = math.prod(shape_) * dtype.itemsize
        if device.type != "cpu" or nbytes < self.min_bytes:
            return (torch.zeros if zeros else torch.empty)(shape_, dtype=dtype, device=device)
        free = [s for s in self.blocks if torch._C._storage_Use_Count(s._cdata) == 1]  # (held by this list only)
        block = next((s for s in free if nbytes <= s.nbytes() <= 2 * nbytes), None)
        if block is None:
            if len(self.blocks) >= self.max_blocks and free:
                self.blocks.remove(free[0])
            block = torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
            if len(self.blocks) < self.max_blocks:
                self.blocks.append(block)
        out = torch.empty((0,), dtype=torch.uint8).set_(block)[:nbytes].view(dtype).view(shape_)
        return out.zero_() if zeros else out


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

    def _layout(self, c: DispatchCall | CombineCall, what: str) -> Any:
        """The layout module's ``what`` (``layout`` or ``combine_jobs``) of ``c``, for the next call's set of tensors
        (it checks the call against a handle / capacity: a rejection is told to the peers)."""
        self.tag ^= 1
        self.device = c.x.device
        with self.rejecting(c.op, tp=c.experts.tp):
            return getattr(LAYOUTS[c.layout], what)(c, self)

    def _dispatch(self, c: DispatchCall) -> InFlight:
        layout: Layout = self._layout(c, "layout")
        plan, fmt, me = layout.plan, layout.fmt, self.rank
        encode = encoder(fmt, layout.source, plan, layout.weights, layout.smooth)
        if (fields := getattr(layout, "fields", None)) is not None:  # (the row bytes past the source's)
            encode = functools.partial(_then, encode, fields)
        own_rows = self.scratch("dispatch_own", (plan.rows_per_dest[me], fmt.row_bytes), torch.uint8)

        def own() -> None:  # placed now, while the rows travel (where the layout can)
            place_own = getattr(layout, "place_own", lambda _, encode_own: encode_own())
            place_own(own_rows, functools.partial(encode, False, me, own_rows))

        def place(agreement: Agreement, parts: Parts, wait_ns: int) -> Any:
            layout.place(parts, (me, own_rows), agreement, wait_ns)
            return layout.result()

        counts = [[n, k] for n, k in zip(plan.rows_per_dest, layout.known or [-1] * self.num_ranks, strict=True)]
        more = getattr(layout, "check", None)
        receive = self._exchange("dispatch", c.op, layout, counts, layout.vectors, encode, more, own, place)
        return InFlight(receive, layout.result())

    def combine(self, call: CombineCall) -> InFlight:
        first: list[Any] = []  # a shrink-mode re-run writes the tensor the first attempt returned

        def start() -> InFlight:
            inflight = self._combine(call if not first else dataclasses.replace(call, out=first[0]))
            first.append(inflight.value)
            return inflight

        return self._run(start)

    def _combine(self, c: CombineCall) -> InFlight:
        jobs: list[reduce.CombineJob] = self._layout(c, "combine_jobs")
        last = len(jobs) - 1  # (a peer's rejection stops the next: only the last job starts before its agreement)
        receives = [self._combine_job(c, job, i, i == last) for i, job in enumerate(jobs)]
        outs = [out for job in jobs for out in (job.out, *(rider.out for rider in job.riders))]
        value = outs[0] if len(outs) == 1 else tuple(outs)
        return InFlight(lambda: [receive() for receive in receives] and value, value)

    def _combine_job(self, c: CombineCall, job: reduce.CombineJob, i: int, last: bool) -> InFlight:
        plan, me, group = job.plan, self.rank, [job, *job.riders]  # (riders: columns after the job's in each row)
        starts = [sum(job.rows_per_src[:q]) for q in range(self.num_ranks)]
        ends = [sum(j.fmt.row_bytes for j in group[: k + 1]) for k in range(len(group))]
        columns = [slice(end - j.fmt.row_bytes, end) for j, end in zip(group, ends, strict=True)]

        def write(remote: bool, q: int, out: torch.Tensor) -> None:
            for j, cols in zip(group, columns, strict=True):
                rows, dst, fmt = j.return_rows[starts[q] : starts[q] + j.rows_per_src[q]], out[:, cols], j.fmt
                if fmt.quantized:
                    fmt.encode(j.source.index_select(0, rows), dst)
                elif not remote or not kernels.gather(j.source, rows, dst.view(fmt.dtype)):
                    torch.index_select(j.source, 0, rows, out=dst.view(fmt.dtype))

        # own rows now, unless the TP stage changes the source first or the handle is inconsistent (check raises)
        early = job.tp is None and job.rows_per_src[me] == plan.pairs_per_dest[me]
        scratches = [functools.partial(self.scratch, job=i + 100 * k) for k in range(len(group))]  # (own rows first)

        def own() -> None:
            for j, scratch in zip(group, scratches, strict=True):
                reduce.reduce_own(j, scratch)

        def finish(agreement: Agreement, parts: Parts, wait_ns: int) -> None:
            for j, scratch, cols in zip(group, scratches, columns, strict=True):
                reduce.reduce_remote(j, scratch, agreement, [(q, p[:, cols]) for q, p in parts], wait_ns)

        more = functools.partial(reduce.check, job, self.ep)
        # the rows each source returns are known (the handle): the payload starts before the agreement (see
        # transports.early), when every agreeing rank's rows fit the bound, the same on every rank (``capacity``)
        known = last and job.tp is None and 0 < job.capacity * ends[-1] <= self.early_bytes
        counts = [[n, k if known else -1] for n, k in zip(job.rows_per_src, plan.pairs_per_dest, strict=True)]
        vectors = (*job.rows_per_src, *plan.pairs_per_dest)
        receive = self._exchange(
            "combine", c.op, job, counts, vectors, write, more, own if early else None, finish, ends[-1]
        )
        return InFlight(receive, job.out)

    def _exchange(
        self,
        kind: str,
        op: str,
        sender: Any,
        counts: list[list[int]],
        vectors: Sequence[int],
        write: Callable[[bool, int, torch.Tensor], None],
        more: Check | None,
        own: Callable[[], None] | None,
        finish: Callable[[Agreement, Parts, int], Any],
        row_bytes: int = 0,
    ) -> Callable[[], Any]:
        """One exchange of ``sender`` (the layout or the combine job): send (``write(remote, d, out)``: the rows for
        rank d; a TP pair's peer is told when the EP call fails before their agreement), check the headers (status,
        ``more``, the fingerprint), run ``own()`` (if any) while the rows travel, and return the receive:
        ``finish(agreement, parts, wait_ns)``, timed when :data:`deep_ep_npu.profiling.enabled`."""
        started, tp, device, r = time.perf_counter(), sender.tp, sender.source.device, self.num_ranks
        transport = self.transport_for(device, tp is not None)
        shared = header(row_bytes or sender.fmt.row_bytes, vectors, sender.fingerprint, r)
        self.wire[kind] = ([n * shared[0] for n, _ in counts], 8 * len(shared))  # (profiling.wire_stats)

        def check(agreement: Agreement) -> None:
            check_status(agreement)
            if more is not None:
                more(agreement)
            check_names(agreement, self.ep, sender.names, 1 + 2 * r)
            check_names(agreement, self.ep, ("row size in bytes",), 0)  # (known to match before any row is read)

        write_rows = functools.partial(write, transport is self.window)
        try:
            token = transport.send(
                op,
                counts,
                shared,
                write_rows,
                check,
                agree_now=sender.agree_now,
                device=device,
                before_payload=None if tp is None else tp.before_payload,
            )
        except MoeDistributeError as err:
            if tp is not None:
                tp.abort(err.code)
            raise
        if own is not None:
            own()
        send_s = time.perf_counter() - started

        def receive() -> Any:
            called = time.perf_counter()
            agreement, parts, wait_ns = transport.receive(token)
            received = time.perf_counter()
            try:
                return finish(agreement, parts, wait_ns)
            finally:
                transport.done(token)
                if profiling.enabled:
                    profiling.add(kind, send=send_s, wait=received - called, place=time.perf_counter() - received)

        return receive

    def next_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The `[L, R * N, hidden]` bfloat16 buffer the next ``zero_copy`` combine of ``handle``'s layout reads."""
        self.device = handle.src_info.device
        return self.reused(f"zero_copy{self.tag ^ 1}", (*handle.src_info.shape, handle.hidden), torch.bfloat16)

    def can_fuse(self, call: DispatchCall, ffn: FFN) -> bool:
        """No: the engine runs the pipeline (:mod:`.pipeline`)."""
        return False

    def mega_moe(self, call: DispatchCall, ffn: FFN, fused: bool) -> torch.Tensor:
        return pipeline.run(self, call, ffn)

    def clean(self) -> None:
        self.tag = self.result_set = 0

    def destroy(self) -> None:
        if self.window is not None:
            self.window.close()
        self.collective.close()
        self._reused.clear()
        self.results.blocks.clear()


def _then(
    encode: Callable[[bool, int, torch.Tensor], None],
    fields: Callable[[int, torch.Tensor], None],
    remote: bool,
    d: int,
    out: torch.Tensor,
) -> None:
    encode(remote, d, out)
    fields(d, out)


def header(row_bytes: int, vectors: Sequence[int], fingerprint: Sequence[int], num_ranks: int) -> list[int]:
    """The shared header words of a call: the row size, up to 2R words of vectors, up to :data:`FINGERPRINT` words of
    fingerprint, each part zero-padded."""
    assert len(vectors) <= 2 * num_ranks and len(fingerprint) <= FINGERPRINT, "the layout's header words fit"
    pad = [0] * (2 * num_ranks - len(vectors)) + list(fingerprint) + [0] * (FINGERPRINT - len(fingerprint))
    return [row_bytes, *vectors, *pad]


LAYOUTS = {"masked": masked, "flat": flat, "expand": expand}  # each module's layout(call, engine), combine_jobs
_ENGINES: dict[int, Engine] = {}


def engine_for(group: dist.ProcessGroup) -> Engine:
    """The ops' engine of ``group`` (collective, no shrink, the default timeout), one per group per process."""
    eng = _ENGINES.get(id(group))
    if eng is None or eng.group is not group:
        eng = _ENGINES[id(group)] = Engine(group, reuse=False)
    return eng
