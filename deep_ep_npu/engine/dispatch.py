"""Dispatch: move each token to the ranks hosting its experts and place it by a layout (:mod:`.layouts`).

Send phase (:func:`start_dispatch`): the agreement step starts (status, rows per destination, fingerprint), the
rows are encoded while it travels (:mod:`.rows`; each token once per destination rank) and this rank's own rows,
which never touch the wire, are placed; then the agreement is checked and the remote rows go out in one uneven
all-to-all (with ``defer_payload``, both in the receive phase: the send phase waits for no peer). Receive phase (the
returned :class:`~deep_ep_npu.event.Completion`): the received rows are expanded into one output row per (token,
local expert) at the position the layout computes, written once. (:mod:`.shm` moves the same rows through a
shared-memory window instead.)"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import profiling
from ..event import Completion
from ..group import STATUS_OK, Agreement, EPGroup
from .plan import Plan
from .rows import RowFormat
from .workspace import Workspace

Received = collections.namedtuple("Received", "row slot expert src")
"""Pairs parsed from received rows: `[n]` int64 tensors, in receive order."""


@dataclasses.dataclass
class Incoming:
    """Received dispatch rows: ``rows`` `[n, row_bytes]` uint8 holds source ``src``'s rows at ``rows[begin : begin +
    count]`` for each ``(src, begin, count)`` of ``blocks`` (by source rank; masked sources left out)."""

    rows: torch.Tensor
    blocks: list[tuple[int, int, int]]

    @classmethod
    def from_one(cls, rows: torch.Tensor, src: int) -> Incoming:
        return cls(rows, [(src, 0, rows.shape[0])])

    def sources(self) -> list[tuple[int, torch.Tensor]]:
        """``(src, rows)`` of every block."""
        return [(src, self.rows[begin : begin + count]) for src, begin, count in self.blocks]

    def parse(self, fmt: RowFormat) -> Received:
        """The (row of ``rows``, slot, local expert, source) of every pair the rows carry."""
        dev, blocks = self.rows.device, [b for b in self.blocks if b[2]]
        if not blocks:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return Received(empty, empty, empty, empty)
        index = torch.cat([torch.arange(b, b + c, device=dev) for _, b, c in blocks])
        src = torch.cat([torch.full((c,), s, dtype=torch.int64, device=dev) for s, _, c in blocks])
        table = fmt.slot_experts(self.rows)[index]
        i, slot = (table >= 0).nonzero(as_tuple=True)
        return Received(index[i], slot, table[i, slot].long(), src[i])


@dataclasses.dataclass
class DispatchJob:
    """One validated dispatch. ``weights`` `[P]` fp32: the per-pair weight to carry (or None); ``smooth``
    `[num_rows, hidden]` fp32: per-row int8 smoothing; ``fingerprint``: the values every rank must agree on
    (``layout.names`` names them)."""

    ep: EPGroup
    op: str
    x: torch.Tensor
    plan: Plan
    fmt: RowFormat
    weights: torch.Tensor | None
    smooth: torch.Tensor | None
    fingerprint: tuple[int, ...]
    layout: Any  # Masked | Flat
    workspace: Workspace
    tag: str = ""  # workspace names of the wire buffers (double-buffering)
    before_send: Callable[[], bool] | None = None  # runs after the agreement, before the payload (the TP pair's)
    known_counts: list[int] | None = None  # rows each source sends here, already known (a cached layout), see below
    defer_payload: bool = False  # the send phase does not wait for the agreement: the payload starts in the receive


def slot_tables(job: DispatchJob, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row and slot: the local expert `[num_rows, num_slots]` int32 (-1: unused slot) and the pair's weight
    `[num_rows, num_slots]` fp32 (None without ``job.weights``), as the rows carry them."""
    plan, fmt, dev = job.plan, job.fmt, job.x.device
    slot_expert = plan.slot_expert
    if slot_expert is None or slot_expert.shape != (num_rows, fmt.num_slots):
        slot_expert = torch.full((num_rows, fmt.num_slots), -1, dtype=torch.int32, device=dev)
        slot_expert[plan.row_of_pair, plan.slot] = plan.expert.to(torch.int32)
    if job.weights is None:
        return slot_expert, None
    weights = torch.zeros((num_rows, fmt.num_slots), dtype=torch.float32, device=dev)
    weights[plan.row_of_pair, plan.slot] = job.weights
    return slot_expert, weights


def row_encoder(job: DispatchJob, slot_expert: torch.Tensor,
                weights: torch.Tensor | None) -> Callable[[torch.Tensor, slice, bool], None]:  # fmt: skip
    """``encode(out, rows, remote)``: the plan's rows ``rows`` into ``out`` `[n, row_bytes]` (``remote``: a peer
    reads ``out``). Quantized rows without smoothing, when some token goes to more than one rank: each token is
    quantized once per call (not once per rank it goes to) and its bytes are copied into its rows."""
    fmt, x, plan, encoded = job.fmt, job.x, job.plan, list[torch.Tensor]()
    once = fmt.quant is not None and job.smooth is None and plan.row_token.numel() > x.shape[0]

    def encode(out: torch.Tensor, rows: slice, remote: bool) -> None:
        w = None if weights is None else weights[rows]
        if once:
            if not encoded:
                encoded.append(fmt.encode_tokens(x))
            fmt.encode_copies(out, encoded[0], plan.row_token[rows], slot_expert[rows], w, remote)
        else:
            smooth = None if job.smooth is None else job.smooth[rows]
            fmt.encode_gathered(out, x, plan.row_token[rows], slot_expert[rows], w, smooth, remote=remote)

    return encode


def place_own(job: DispatchJob, own_rows: torch.Tensor, encode: Callable[[], None]) -> Incoming:
    """Place this rank's own pairs: straight from ``job.x`` where the layout can (``own_rows`` stay unfilled: that
    layout does not read them), else ``encode()`` them into ``own_rows`` `[rows, row_bytes]` first. Returns the own
    rows as the layout's ``place_remote`` takes them."""
    plan, me, own = job.plan, job.ep.rank, Incoming.from_one(own_rows, job.ep.rank)
    pairs = slice(lo := sum(plan.pairs_per_dest[:me]), lo + plan.pairs_per_dest[me])
    if (
        job.weights is not None
        or job.smooth is not None
        or not job.layout.place_own_direct(job.fmt, job.x, plan.token[pairs], plan.expert[pairs])
    ):
        encode()
        job.layout.place_own(job.fmt, own)
    return own


def start_dispatch(job: DispatchJob) -> Completion:
    """Run the send phase; the returned completion runs the receive phase and fills ``job.layout``'s outputs. The send
    phase starts the agreement step, packs and places this rank's own rows, then waits for the agreement and starts
    the payload; with ``job.defer_payload`` it waits for nothing: the receive phase waits for the agreement, checks
    it and only then moves the payload (its size depends on the counts).

    With ``job.known_counts`` (the rows each source sends here, already known) nothing waits for the counts: the
    agreement step (the same row, so a peer without known counts still matches it) travels alongside the payload
    instead of before it, and is checked (``job.layout.check``) in the receive phase, before anything is placed."""
    ep, plan, fmt, x, ws = job.ep, job.plan, job.fmt, job.x, job.workspace
    me, r, dev, lap = ep.rank, ep.num_ranks, x.device, profiling.laps("dispatch")
    known = job.known_counts
    counts = [[plan.rows_per_dest[d], plan.pairs_per_dest[d]] for d in range(r)]
    finish_agree = ep.start_agree(job.op, STATUS_OK, counts, job.fingerprint, device=dev)
    profiling.record_wire("dispatch", [k * fmt.row_bytes for k in plan.rows_per_dest], me, 8 * len(job.fingerprint))
    num_rows = int(plan.row_token.numel())
    send = ws.get(f"dispatch_send{job.tag}", (num_rows, fmt.row_bytes), torch.uint8)
    slot_expert, weights = slot_tables(job, num_rows)
    remote, mine = slice(0, plan.num_remote_rows), slice(plan.num_remote_rows, num_rows)

    encode = row_encoder(job, slot_expert, weights)
    encode(send[remote], remote, False)
    lap("packing")  # (while the agreement travels)
    own = place_own(job, send[mine], lambda: encode(send[mine], mine, False))
    lap("unpacking_self")

    def start_payload(known: list[int]) -> tuple[list[int], torch.Tensor, Completion]:
        if job.before_send is not None:
            job.before_send()
        recv_rows = [0 if s == me else c for s, c in enumerate(known)]
        send_rows = [0 if d == me else k for d, k in enumerate(plan.rows_per_dest)]
        recv = ws.get(f"dispatch_recv{job.tag}", (sum(recv_rows), fmt.row_bytes), torch.uint8)
        return recv_rows, recv, ep.transfer(recv, send[: plan.num_remote_rows], recv_rows, send_rows,
                                            "payload exchange")  # fmt: skip

    agreed = None
    if known is None and not job.defer_payload:  # wait for the counts now (peers' errors raise in the send phase)
        agreed = finish_agree()
        job.layout.check(agreed)
        known = [c[0] for c in agreed.counts]
        lap("header_wait")
    started = None if known is None else start_payload(known)

    def agree_and_start() -> tuple[Agreement, tuple[list[int], torch.Tensor, Completion]]:
        got = finish_agree()
        job.layout.check(got)
        return got, start_payload([c[0] for c in got.counts])

    deferred = ep.defer(agree_and_start) if started is None else None  # payloads start in call order

    def finish() -> None:
        lap = profiling.laps("dispatch")
        if deferred is not None:  # the counts arrive with the agreement, the payload starts now
            got, (recv_rows, recv, transfer) = deferred()
            lap("header_wait")
            wait_ns = transfer.wait()
        else:
            assert started is not None
            recv_rows, recv, transfer = started
            wait_ns = transfer.wait()
            got = agreed if agreed is not None else finish_agree()
            if agreed is None:  # no count exchange: the status and fingerprint are checked now
                job.layout.check(got)
        agreed_now = got
        lap("collective_wait")
        begins = [sum(recv_rows[:s]) for s in range(r)]
        masked = ep.mask.tolist()
        blocks = [(s, begins[s], recv_rows[s]) for s in range(r) if s != me and not masked[s]]
        job.layout.place_remote(fmt, Incoming(recv, blocks), own, agreed_now, wait_ns)
        lap("unpacking")

    return Completion(finish)
