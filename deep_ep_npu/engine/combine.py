"""Combine: return expert outputs to their source ranks and reduce them there, in fp32.

The expert rank sends each received row back to its source, grouped by source in the order the source's own plan
predicts (:mod:`.plan`), so only rows travel. The agreement step carries every rank's full send and expect
vectors, so a handle or top-k that does not match the dispatch is reported on every rank instead of hanging the
all-to-all. Rows for this rank itself never touch the wire.

Reduction order: with ``by_slot`` (the Ascend ops) ``out[t] = sum_k c[t, k]`` over slots k ascending, then
``shared_expert_x[t]``; otherwise (DeepEP) this rank's own experts first, then the remote ranks in rank order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import kernels as cpu_kernels
from .. import profiling
from ..errors import shape
from ..event import Completion
from ..group import STATUS_OK, Agreement, EPGroup
from .plan import Plan
from .rows import ReturnFormat
from .workspace import Workspace


@dataclasses.dataclass
class CombineJob:
    """One validated combine. ``source`` `[rows, hidden]`: the expert outputs; ``return_rows`` `[n]` int64: its rows
    to send back, grouped by source rank (``rows_per_src``); ``plan``: this rank's pairs; ``weights`` `[P]` fp32 per
    pair; ``extra``: (token, slot, value `[n, hidden]` fp32) contributions computed locally (copy / const experts);
    ``addend`` `[T, hidden]` added at the end (``shared_expert_x``); ``active``: tokens ``[0, active)`` are written,
    the rest 0."""

    ep: EPGroup
    op: str
    source: torch.Tensor
    return_rows: torch.Tensor
    rows_per_src: list[int]
    plan: Plan
    weights: torch.Tensor
    fmt: ReturnFormat
    num_tokens: int
    out: torch.Tensor
    fingerprint: tuple[int, ...]
    names: tuple[str, ...]
    mismatch: tuple[str, str]  # (parameter, what to pass) named when sends and expects disagree
    workspace: Workspace
    tag: str = ""
    by_slot: bool = False
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    addend: torch.Tensor | None = None
    active: int | None = None
    on_wait: Callable[[Agreement, int], None] | None = None  # the wait statistics
    before_send: Callable[[], bool] | None = None  # after the agreement, before the payload; True: re-pack
    defer_payload: bool = False  # the send phase does not wait for the agreement: the payload starts in the receive


def start_combine(job: CombineJob) -> Completion:
    """Run the send phase (start the agreement, pack, reduce this rank's own rows, check the agreement and start the
    payload; with ``job.defer_payload`` the last two move to the receive phase: the send phase waits for no peer); the
    returned completion receives and reduces into ``job.out``."""
    ep, plan, fmt, ws = job.ep, job.plan, job.fmt, job.workspace
    me, r, dev, lap = ep.rank, ep.num_ranks, job.source.device, profiling.laps("combine")
    shared = (*job.rows_per_src, *plan.pairs_per_dest, *job.fingerprint)
    neutral = (0,) * (2 * r) + tuple(job.fingerprint)
    finish_agree = ep.start_agree(job.op, STATUS_OK, [[] for _ in range(r)], shared, neutral, device=dev)
    profiling.record_wire("combine", [k * fmt.row_bytes for k in job.rows_per_src], me, 8 * len(shared))
    own_src = own_return_rows(job)
    remote = torch.cat([job.return_rows[: own_src.start], job.return_rows[own_src.stop :]])
    send = ws.get(f"combine_send{job.tag}", (remote.numel(), fmt.row_bytes), torch.uint8)

    def pack() -> None:
        if fmt.quantized:
            fmt.encode(job.source.index_select(0, remote), send)
        else:
            torch.index_select(job.source, 0, remote, out=send.view(fmt.dtype))

    pack()
    lap("packing")  # (while the agreement travels)
    # own rows now unless the TP stage changes the source first, or the handle is inconsistent (the check raises)
    early = job.before_send is None and job.rows_per_src[me] == plan.pairs_per_dest[me]
    local = reduce_own(job) if early else None
    lap("unpacking_self")

    def start_payload() -> tuple[Agreement, torch.Tensor, Completion]:
        agreement = finish_agree()
        check_agreement(job, agreement)
        if job.before_send is not None and job.before_send():
            pack()
        lap("header_wait")
        recv_rows = [0 if s == me else fp[me] for s, fp in enumerate(agreement.shared)]
        send_rows = [0 if s == me else k for s, k in enumerate(job.rows_per_src)]
        recv = ws.get(f"combine_recv{job.tag}", (sum(recv_rows), fmt.row_bytes), torch.uint8)
        return agreement, recv, ep.transfer(recv, send, recv_rows, send_rows, "payload exchange")

    # (peers' errors raise in the send phase; deferred payloads start in call order)
    started = None if job.defer_payload else start_payload()
    deferred = ep.defer(start_payload) if started is None else None

    def finish() -> None:
        lap = profiling.laps("combine")
        if deferred is not None:
            agreement, recv, transfer = deferred()
        else:
            assert started is not None
            agreement, recv, transfer = started
        own = local if local is not None else reduce_own(job)
        wait_ns = transfer.wait()
        lap("collective_wait")
        reduce_remote(job, own, [recv], agreement, wait_ns)
        lap("unpacking")

    return Completion(finish)


def check_agreement(job: CombineJob, agreement: Agreement) -> None:
    """Raise (the same error on every rank) if a rank rejected its input, the ranks' send and expect vectors
    disagree (a wrong handle or top-k) or a fingerprint value differs."""
    me, r = job.ep.rank, job.ep.num_ranks
    agreement.check(me, ())
    sends = [fp[:r] for fp in agreement.shared]  # sends[p][q]: rows rank p returns to rank q
    expects = [fp[r : 2 * r] for fp in agreement.shared]  # expects[q][p]: pairs rank q sent to rank p
    if bad := [(p, q) for p in range(r) for q in range(r) if sends[p][q] != expects[q][p]]:
        (p, q), (param, hint) = bad[0], job.mismatch
        raise shape(param, f"rank {p} would return {sends[p][q]} rows to rank {q}, which dispatched {expects[q][p]} "
                    f"pairs to it; pass {hint} (mismatched rank pairs: {bad[:8]})")  # fmt: skip
    agreement.check(me, job.names, offset=2 * r)


def own_return_rows(job: CombineJob) -> slice:
    """Where this rank's own rows sit in ``job.return_rows`` (sources in rank order)."""
    me = job.ep.rank
    return slice(lo := sum(job.rows_per_src[:me]), lo + job.rows_per_src[me])


@dataclasses.dataclass
class Local:
    """The part of a combine this rank computes without waiting: ``acc`` `[T, hidden]` fp32 (own experts' rows
    added unless ``by_slot``), own rows ``own_y`` `[own pairs, hidden]` fp32 (None when they went straight into
    ``acc``), the own pairs and the remote ones."""

    acc: torch.Tensor
    own_y: torch.Tensor | None
    own: slice
    remote_pairs: torch.Tensor


def _fused(job: CombineJob) -> bool:
    """Whether rows go straight into the fp32 sum (:func:`~.cpu_kernels.accumulate`) instead of through scratch."""
    return not job.by_slot and not job.fmt.quantized and job.source.device.type == "cpu"


def _fused_by_slot(job: CombineJob) -> bool:
    """Whether the slot-ordered sum runs in one pass (:func:`~.cpu_kernels.accumulate_rows`) from the rows where
    they are (no scratch copy): rows in the source's dtype, no copy / const contributions, the kernels there."""
    fmt, src = job.fmt, job.source
    return (job.by_slot and not fmt.quantized and job.extra is None and src.device.type == "cpu"
            and src.dtype == fmt.dtype and cpu_kernels.library() is not None)  # fmt: skip


def reduce_own(job: CombineJob) -> Local:
    """Reduce this rank's own expert rows (they never touch the wire)."""
    plan, fmt, me, dev = job.plan, job.fmt, job.ep.rank, job.source.device
    own_src = own_return_rows(job)
    own = slice(lo := sum(plan.pairs_per_dest[:me]), lo + plan.pairs_per_dest[me])  # this rank's own pairs
    token, rows, ws = plan.token, job.return_rows[own_src], job.workspace
    remote_pairs = torch.cat([torch.arange(own.start, device=dev), torch.arange(own.stop, token.numel(), device=dev)])
    acc = ws.get(f"combine_acc{job.tag}", (job.num_tokens, fmt.hidden), torch.float32)
    if _fused(job) and cpu_kernels.accumulate(acc, job.source, rows, token[own], job.weights[own], zero_first=True):
        return Local(acc, None, own, remote_pairs)
    if _fused_by_slot(job):  # summed with the remote rows, in slot order (the receive phase)
        return Local(acc, None, own, remote_pairs)
    acc.zero_()
    raw = ws.get(f"combine_own{job.tag}", (rows.numel(), fmt.hidden), job.source.dtype)
    torch.index_select(job.source, 0, rows, out=raw)
    if fmt.quantized:  # own rows take the same int8 round trip as the remote ones
        packed = torch.empty((raw.shape[0], fmt.row_bytes), dtype=torch.uint8, device=dev)
        fmt.encode(raw, packed)
        own_y = fmt.decode_float(packed)
    else:  # converted into reused scratch (a fresh tensor of this size costs its page faults every call)
        own_y = ws.get(f"combine_own_f{job.tag}", tuple(raw.shape), torch.float32).copy_(raw)
    if not job.by_slot:
        _accumulate(acc, own_y, token[own], job.weights[own].unsqueeze(1))
    return Local(acc, own_y, own, remote_pairs)


def reduce_remote(job: CombineJob, local: Local, parts: list[torch.Tensor], agreement: Agreement,
                  wait_ns: int) -> None:  # fmt: skip
    """Add the received rows ``parts`` (each `[n_i, row_bytes]` uint8, by source rank, in this rank's plan order) in
    the documented order and write ``job.out``."""
    plan, fmt, acc = job.plan, job.fmt, local.acc
    if job.by_slot:  # slot after slot, ascending
        if local.own_y is not None or not _sum_by_slot(job, local, parts):
            _sum_by_slot_torch(job, local, parts)
    else:
        tok, w, begin, done = plan.token[local.remote_pairs], job.weights[local.remote_pairs], 0, 0
        for p in parts if _fused(job) else ():  # straight into the sum, part by part (in order)
            pairs = slice(begin, begin + len(p))
            if not cpu_kernels.accumulate(acc, p.view(fmt.dtype), None, tok[pairs], w[pairs]):
                break
            begin, done = pairs.stop, done + 1
        if rest := parts[done:]:  # the torch code for what the kernel did not take
            _accumulate(acc, decode_rows(job, rest), tok[begin:], w[begin:].unsqueeze(1))
    if job.addend is not None:
        acc.add_(job.addend.float())
    if job.active is not None:
        acc[job.active :] = 0.0
    job.out.copy_(acc)
    if job.on_wait is not None:
        job.on_wait(agreement, wait_ns)


def _sum_by_slot(job: CombineJob, local: Local, parts: list[torch.Tensor]) -> bool:
    """The by-slot sum in one pass, reading the own rows from ``job.source`` and the received ones from ``parts``
    where they are (:func:`~.cpu_kernels.accumulate_rows`): per token, slots ascending, each product and sum rounded
    to fp32 as the torch code's. False (nothing done) where the kernel does not apply."""
    plan, own, remote_pairs, dev = job.plan, local.own, local.remote_pairs, job.source.device
    y_at = torch.empty_like(plan.token)  # pair -> its row among [own rows, then the received parts' rows]
    y_at[own] = torch.arange(own.stop - own.start, device=dev)
    y_at[remote_pairs] = torch.arange(remote_pairs.numel(), device=dev) + (own.stop - own.start)
    order = torch.argsort(plan.slot, stable=True)
    rows = [(job.source, job.return_rows[own_return_rows(job)]), *((p.view(job.fmt.dtype), None) for p in parts)]
    return cpu_kernels.accumulate_rows(local.acc, rows, y_at[order], plan.token[order], job.weights[order])


def _sum_by_slot_torch(job: CombineJob, local: Local, parts: list[torch.Tensor]) -> None:
    """The by-slot sum in torch, with the ``extra`` contributions (own rows as fp32 when :func:`reduce_own` left them
    to the kernel, which did not apply: then ``acc`` starts from zeros here)."""
    plan, fmt, acc, dev = job.plan, job.fmt, local.acc, job.source.device
    if local.own_y is None:
        local.own_y = job.source.index_select(0, job.return_rows[own_return_rows(job)]).float()
        acc.zero_()
    values = torch.empty((plan.token.numel(), fmt.hidden), dtype=torch.float32, device=dev)
    values[local.own], values[local.remote_pairs] = local.own_y, decode_rows(job, parts)
    tok, slot, values = plan.token, plan.slot, values.mul_(job.weights.unsqueeze(1))
    if job.extra is not None:
        tok, slot, values = (torch.cat([a, b]) for a, b in zip((tok, slot, values), job.extra, strict=True))
    for k in torch.unique(slot).tolist():
        sel = (slot == k).nonzero(as_tuple=True)[0]
        acc.index_add_(0, tok[sel], values[sel])


def decode_rows(job: CombineJob, parts: list[torch.Tensor]) -> torch.Tensor:
    """The received rows ``parts`` (each `[n_i, row_bytes]` uint8, by source rank) as one `[sum n_i, hidden]` fp32
    tensor (reused scratch when the rows are not quantized; :meth:`ReturnFormat.decode_float`'s values)."""
    fmt, total = job.fmt, sum(p.shape[0] for p in parts)
    y = job.workspace.get(f"combine_y{job.tag}", (total, fmt.hidden), torch.float32)
    begin = 0
    for p in parts:
        n = p.shape[0]
        if fmt.quantized:
            y[begin : begin + n] = fmt.decode_float(p)
        elif n:
            y[begin : begin + n].copy_(p.view(fmt.dtype))
        begin += n
    return y


def _accumulate(acc: torch.Tensor, y: torch.Tensor, token: torch.Tensor, weights: torch.Tensor) -> None:
    """``acc[token[i]] += weights[i] * y[i]`` in fp32 (``y`` `[k, hidden]`, weights `[k, 1]` fp32; ``y`` is scratch,
    converted or scaled in place: a mixed-dtype mul would be slower)."""
    if token.numel():
        acc.index_add_(0, token, y.float().mul_(weights))
