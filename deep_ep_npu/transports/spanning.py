"""The spanning transport: a group whose ranks sit on several hosts, with at least two on this one. In the same call
the rows for this host's peers go through its shared-memory window (:class:`~.window.Window`, written straight into
their regions) and the rows for the other hosts' ranks through torch.distributed (:class:`~.collective.Collective`,
told to leave this host's peers out); the header words of every rank travel in the collective agreement, so the
check, the errors and failure detection (who is missing, shrink) are the collective transport's, unchanged. The
window's header to a peer only says that its rows are written. The send phase waits for no peer (as either
transport's); the receive takes the agreement and the other hosts' rows, then this host's rows where they lie. The
rows are the same bytes whichever way they travel: results are bit-identical to either transport alone."""

from __future__ import annotations

import dataclasses
import time

import torch

from .agreement import Agreement, Received, Send, Ticket
from .collective import Collective
from .failure import EPRankFailure
from .window import Call, PeerLost, Window


class Spanning:
    """``window``: this host's ranks; ``collective``: the group's, built with ``local`` = the window's peers."""

    name = "spanning"

    def __init__(self, window: Window, collective: Collective) -> None:
        assert collective.local == frozenset(window.peers), "the collective leaves the window's peers out"
        self.window, self.collective, self.ep = window, collective, window.ep
        window.spanning = True

    def send(self, request: Send) -> SpanningTicket:
        call, lost = self.window.start(request, self.reject), ""
        try:
            self.window.write(call, request)
        except PeerLost:  # the agreement below fails on every rank (the peer is missing there too)
            lost = f"a peer on this host stopped reading its window during {request.op}"
        try:
            ticket = self.collective.send(request)
        except BaseException:
            self.window.release(call)
            raise
        return SpanningTicket(self, call, ticket, lost)

    def receive(self, call: Call, ticket: Ticket, lost: str) -> Received:
        """The collective part of ``call`` (the agreement and the other hosts' rows), then this host's rows."""
        try:
            got = ticket.receive()
            if lost:
                self.ep.broken = True
                raise EPRankFailure((), call.op, self.ep.timeout, unknown=lost)
            t0 = time.perf_counter_ns()
            parts = got.parts + self._local_parts(call, got.agreement)
        except BaseException:
            self.window.release(call)
            raise
        parts.sort(key=lambda part: part[0])
        return Received(got.agreement, parts, got.wait_ns + time.perf_counter_ns() - t0)

    def _local_parts(self, call: Call, agreement: Agreement) -> list[tuple[int, torch.Tensor]]:
        """This host's rows of ``call``, once each live peer said they are written (they are: the peer wrote them
        before it joined the agreement)."""
        window, live, masked = self.window, self.window.live_peers(), self.ep.mask.tolist()
        try:
            window.wait_headers(call, live)
        except PeerLost:
            self.ep.broken = True
            raise EPRankFailure((), call.op, self.ep.timeout, unknown="a peer on this host left its window") from None
        row_bytes = agreement.shared[self.ep.rank][0]
        return [
            (s, window.region(self.ep.rank, call, s, row_bytes, agreement.counts[s][0])) for s in live if not masked[s]
        ]

    def reject(self, op: str, code: int, width: int) -> None:
        self.window.reject(op, code, width)
        self.collective.reject(op, code, width)

    def close(self) -> None:
        self.window.close()
        self.collective.close()


@dataclasses.dataclass(frozen=True)
class SpanningTicket:
    """A spanning call in flight: its window call, the collective part's ticket, and why a peer of this host was lost
    during the send ("" if none)."""

    spanning: Spanning
    call: Call
    collective: Ticket
    lost: str

    def receive(self) -> Received:
        return self.spanning.receive(self.call, self.collective, self.lost)

    def done(self) -> None:
        self.spanning.window.release(self.call)
