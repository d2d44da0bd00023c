"""Dispatch and combine over a shared-memory window (:mod:`.window`): the same rows, layouts and reduction as the
collective path (:mod:`.dispatch`, :mod:`.combine`), so results are bit-identical; only the way rows move differs.

Send phase: for each live peer, this rank encodes its rows for that peer straight into the peer's window (its region
for this rank, in the call's half), then posts the peer a header carrying what the agreement step carries (status,
counts, fingerprint). No count round trip, nothing waited for: a peer that has not called yet reads it all later.
Receive phase: wait (bounded) for every live peer's header, run the agreement checks on them (every rank sees the
same headers, so every rank raises the same error), place / reduce the rows from this rank's own window, then tell
each peer its region was read.

A rank whose rows for a peer exceed the region (``num_rdma_bytes`` too small) rejects the call: it posts that status
and raises; its peers raise on reading it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels as cpu_kernels
from .. import profiling
from ..errors import invalid
from ..event import Completion
from ..group import STATUS_OK, Agreement
from .combine import CombineJob, check_agreement, reduce_own, reduce_remote
from .dispatch import DispatchJob, Incoming, place_own, row_encoder, slot_tables
from .window import DATA_OFFSET, Call, ShmWindow


def _too_small(win: ShmWindow, call: Call, rows: list[int], row_bytes: int, words: int) -> None:
    """Reject the call when a peer's rows do not fit its region (posting the status to every live peer)."""
    limit = win.rows_per_region(row_bytes)
    if bad := [(d, k) for d, k in enumerate(rows) if k > limit]:
        (dest, rows_needed), r = max(bad, key=lambda b: b[1]), win.ep.num_ranks
        need = DATA_OFFSET + 2 * r * rows_needed * row_bytes
        what = f"{call.op} sends {rows_needed} rows of {row_bytes} bytes to rank {dest}, its window holds {limit}"
        err = invalid("num_rdma_bytes", f"{what} per source; pass num_rdma_bytes >= {need} (shared-memory window)")
        for d in win.live_peers():
            win.claim(call, d)
            win.post(call, d, [err.code, *([0] * words)])
        win.release(call)
        raise err


def _receive(win: ShmWindow, call: Call, section: str, own: list[int], width: int, neutral: tuple[int, ...],
             use: Callable[[Agreement, int], None]) -> Completion:  # fmt: skip
    """The receive phase of ``call``: wait (bounded) for every live peer's header, build the agreement step's result
    from the headers (``[status, *counts (width), *shared]`` per source; this rank's own words ``own``; ranks removed
    by shrink mode read as status 0, zero counts and ``neutral``), run ``use(agreement, wait_ns)`` on it, then tell
    the peers their regions were read."""

    def finish() -> None:
        lap = profiling.laps(section)
        try:
            headers, wait_ns = win.wait_headers(call)
            lap("collective_wait")
            fill = [STATUS_OK, *([0] * width), *neutral]
            rows = [own if s == win.ep.rank else headers.get(s, fill) for s in range(win.ep.num_ranks)]
            use(Agreement([w[0] for w in rows], [list(w[1 : 1 + width]) for w in rows],
                          [tuple(w[1 + width :]) for w in rows], wait_ns // 1000, call.op), wait_ns)  # fmt: skip
        finally:
            win.release(call)
        lap("unpacking")

    return Completion(finish)


def start_dispatch_shm(job: DispatchJob, win: ShmWindow) -> Completion:
    """:func:`~.dispatch.start_dispatch` over ``win`` (``job.before_send`` must be None)."""
    assert job.before_send is None, "the TP stage runs on the collective transport"
    ep, plan, fmt, ws = job.ep, job.plan, job.fmt, job.workspace
    me, r, lap = ep.rank, ep.num_ranks, profiling.laps("dispatch")
    call = win.begin(job.op)
    words = 2 + len(job.fingerprint)
    profiling.record_wire("dispatch", [k * fmt.row_bytes for k in plan.rows_per_dest], me, 8 * (words + 4))
    _too_small(win, call, [0 if d == me else k for d, k in enumerate(plan.rows_per_dest)], fmt.row_bytes, words)
    num_rows = int(plan.row_token.numel())
    encode = row_encoder(job, *slot_tables(job, num_rows))
    begin, counts = 0, [[plan.rows_per_dest[d], plan.pairs_per_dest[d]] for d in range(r)]

    for d in (d for d in range(r) if d != me):  # remote ranks first (the plan puts this rank's rows last)
        k, rows = plan.rows_per_dest[d], slice(begin, begin + plan.rows_per_dest[d])
        begin += k
        if d in ep.live:
            win.claim(call, d)
            encode(win.region(d, call, me, fmt.row_bytes, k), rows, True)
            win.post(call, d, [STATUS_OK, *counts[d], *job.fingerprint])
    lap("packing")
    own_rows = ws.get(f"dispatch_send{job.tag}", (plan.rows_per_dest[me], fmt.row_bytes), torch.uint8)
    mine = slice(begin, begin + plan.rows_per_dest[me])
    own = place_own(job, own_rows, lambda: encode(own_rows, mine, False))
    lap("unpacking_self")

    def place(agreement: Agreement, wait_ns: int) -> None:
        job.layout.check(agreement)
        rows, m = win.own_regions(call, fmt.row_bytes)
        masked = ep.mask.tolist()
        blocks = [(s, s * m, c[0]) for s, c in enumerate(agreement.counts) if s != me and not masked[s]]
        job.layout.place_remote(fmt, Incoming(rows, blocks), own, agreement, wait_ns)

    own_words = [STATUS_OK, *counts[me], *job.fingerprint]
    return _receive(win, call, "dispatch", own_words, 2, tuple(job.fingerprint), place)


def start_combine_shm(job: CombineJob, win: ShmWindow) -> Completion:
    """:func:`~.combine.start_combine` over ``win`` (``job.before_send`` must be None)."""
    assert job.before_send is None, "the TP stage runs on the collective transport"
    ep, plan, fmt = job.ep, job.plan, job.fmt
    me, r, lap = ep.rank, ep.num_ranks, profiling.laps("combine")
    call = win.begin(job.op)
    shared = (*job.rows_per_src, *plan.pairs_per_dest, *job.fingerprint)
    profiling.record_wire("combine", [k * fmt.row_bytes for k in job.rows_per_src], me, 8 * (len(shared) + 4))
    _too_small(win, call, [0 if s == me else k for s, k in enumerate(job.rows_per_src)], fmt.row_bytes, len(shared))
    begin = 0
    for q, k in enumerate(job.rows_per_src):
        rows, begin = job.return_rows[begin : begin + k], begin + k
        if q == me or q not in ep.live:
            continue
        win.claim(call, q)
        out = win.region(q, call, me, fmt.row_bytes, k)
        if fmt.quantized:
            fmt.encode(job.source.index_select(0, rows), out)
        elif not cpu_kernels.gather(job.source, rows, out.view(fmt.dtype)):
            torch.index_select(job.source, 0, rows, out=out.view(fmt.dtype))
        win.post(call, q, [STATUS_OK, *shared])
    lap("packing")
    consistent = job.rows_per_src[me] == plan.pairs_per_dest[me]  # else the checks below raise before any use
    local = reduce_own(job) if consistent else None
    lap("unpacking_self")

    def reduce(agreement: Agreement, wait_ns: int) -> None:
        check_agreement(job, agreement)
        assert local is not None, "own sends and expects agree once checked"
        counts = [0 if s == me else fp[me] for s, fp in enumerate(agreement.shared)]
        parts = [win.region(me, call, s, fmt.row_bytes, k) for s, k in enumerate(counts) if k]
        reduce_remote(job, local, parts, agreement, wait_ns)

    return _receive(win, call, "combine", [STATUS_OK, *shared], 0, (0,) * (2 * r) + tuple(job.fingerprint), reduce)
