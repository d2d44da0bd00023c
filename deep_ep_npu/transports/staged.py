"""The collective transport's two rounds (:class:`Staged`): one all-to-all of the header words (the agreement), then
one of the rows. The payload starts once the agreement is checked: in the send phase with ``agree_now``, else in the
receive phase (deferred, so that every rank issues its payloads in call order); or at once when this rank knows what
it receives (:mod:`.early`). :class:`~.collective.Collective` hands it the calls it cannot make in one round: a call
with a TP stage (its rows change between the agreement and the payload) and every call on a group that is not gloo
(whose receives must be posted at the sizes sent)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .agreement import STATUS_OK, Agreement, Received, Send
from .collective import Collective, CollectiveTicket, Pending
from .early import OVER_BOUND, PAYLOAD, check_started, early_bytes, started
from .group import EPGroup

Started = tuple[Agreement | None, list[int], torch.Tensor, Pending | None]  # (agreement), posted, recv, payload


def join_started(agreement: Agreement, ep: EPGroup, local: frozenset[int]) -> bool:
    """Join the payloads the peers started before the agreement, sending none on gloo (they posted the bound), else
    zeros of the posted size; whether any had started."""
    peers, bounded = started(agreement, ep.live, ep.rank), early_bytes(ep.num_ranks, ep.device) > 0
    if not peers:
        return False
    recv, send = [0] * ep.num_ranks, [0] * ep.num_ranks
    for s in (s for s in peers if s not in local):  # (this host's peers' rows go another way)
        width = agreement.shared[s][0] if agreement.shared[s] else 0
        recv[s], send[s] = agreement.counts[s][0] * width, 0 if bounded else agreement.counts[s][1] * width
    landing = torch.empty((sum(recv),), dtype=torch.uint8, device=ep.device)
    zeros = torch.zeros((sum(send),), dtype=torch.uint8, device=ep.device)
    ep.wait(ep.all_to_all(landing, zeros, recv, send, PAYLOAD), PAYLOAD)
    return True


class Staged(Collective):
    """The two-round protocol (see the module docstring), on :class:`~.collective.Collective`'s buffers."""

    ep: EPGroup

    def send(self, request: Send) -> CollectiveTicket:
        ep, me, row_bytes, dev = self.ep, self.ep.rank, request.shared[0], request.device or self.ep.device
        counts, before_payload = request.counts, request.before_payload
        self._flip ^= 1
        tag, skip = self._flip, {me, *self.local}
        rows = [0 if d in skip else c[0] for d, c in enumerate(counts)]
        early = all(c[1] >= 0 for s, c in enumerate(counts) if s != me)  # every rank's rows known: start now
        bound = self.early_bytes if early else 0
        over = max(rows) * row_bytes > bound > 0  # (the engine keeps known rows within it: every rank raises)
        finish_agree = ep.start_agree(request.op, OVER_BOUND if over else STATUS_OK, counts, request.shared, dev)
        send = self._buffer(f"send{tag}", sum(rows) * row_bytes, dev).view(sum(rows), row_bytes)

        def write_all() -> None:
            begin = 0
            for d, k in enumerate(rows):
                if k:
                    request.write(d, send[begin : begin + k])
                begin += k

        def start_payload(posted: list[int]) -> tuple[list[int], torch.Tensor, Pending | None]:
            """The rows, ``posted[s]`` bytes received from rank s (this rank's rows sent whole, or none if over)."""
            if before_payload is not None and before_payload():
                write_all()  # (the rows changed: the TP stage)
            recv, sent = self._buffer(f"recv{tag}", sum(posted), dev), [0 if over else k * row_bytes for k in rows]
            src = send.view(-1)[: sum(sent)]
            return posted, recv, ep.all_to_all(recv, src, posted, sent, PAYLOAD) if ep.num_ranks > 1 else None

        def agree_and_start() -> Started:
            agreement = finish_agree()
            if joined := any(c[1] >= 0 for s, c in enumerate(agreement.counts) if s in ep.live and s != me):
                join_started(agreement, ep, self.local)  # (peers that knew what they receive started already)
            request.check(agreement)
            if joined:
                check_started(agreement, ep.live, ep.rank, False)
            return agreement, *start_payload(
                [0 if s in skip else n * row_bytes for s, (n, *_) in enumerate(agreement.counts)]
            )

        write_all()
        if early:  # (at the bound, from every live peer, on gloo; else the known sizes)
            live = set(ep.live) - skip
            exact = [0 if s in skip else c[1] * row_bytes for s, c in enumerate(counts)]
            now = start_payload([bound * (s in live) for s in range(ep.num_ranks)] if bound else exact)
            return CollectiveTicket(lambda: self._receive(request, (None, *now), finish_agree))
        if request.agree_now:
            started_now = agree_and_start()
            return CollectiveTicket(lambda: self._receive(request, started_now))
        deferred = ep.defer(agree_and_start)
        return CollectiveTicket(lambda: self._receive(request, deferred()))

    def _receive(self, request: Send, begun: Started, finish_agree: Callable[[], Agreement] | None = None) -> Received:
        """Wait for the payload ``begun`` (after its agreement, deferred, ran) and check the agreement when the payload
        started before it (``finish_agree``)."""
        (agreement, posted, recv, pending), ep = begun, self.ep
        t0 = time.perf_counter_ns()
        if pending is not None:
            ep.wait(pending, PAYLOAD)
        wait_ns = time.perf_counter_ns() - t0
        if agreement is None:  # the payload started early: the agreement is checked now
            assert finish_agree is not None
            agreement = finish_agree()
            request.check(agreement)
            if any(c[1] < 0 for s, c in enumerate(agreement.counts) if s in ep.live and s != ep.rank):
                check_started(agreement, ep.live, ep.rank, True)
        parts, begin, masked, row_bytes = [], 0, ep.mask.tolist(), agreement.shared[ep.rank][0]
        for s, nbytes in enumerate(posted):  # (each rank's announced rows: within what was posted for it)
            if s != ep.rank and s not in self.local and not masked[s]:
                n = agreement.counts[s][0]
                parts.append((s, recv[begin : begin + n * row_bytes].view(n, row_bytes)))
            begin += nbytes
        return Received(agreement, parts, wait_ns)

    def reject(self, op: str, code: int, width: int, staged: bool = False) -> None:
        join_started(self.ep.start_agree(op, code, [[0, -1]] * self.ep.num_ranks, [0] * width)(), self.ep, self.local)
