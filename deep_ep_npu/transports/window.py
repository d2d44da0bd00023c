"""The window transport: a shared-memory window per rank of one host, and signals on pipes.

A window is an anonymous shared-memory file (``memfd_create``: no name anywhere, so nothing can leak, even after a
crash) of two halves (calls alternate, so the next call never overwrites a result a peer still reads), each cut into
one region per source rank. Send phase: for each live peer, write its rows straight into its region for this rank,
then post the header; nothing is waited for. Receive phase: wait (bounded) for every live peer's header, check them
(the same on every rank, so every rank raises the same error), hand the rows over where they are, then tell each peer
its region was read. Rows that exceed a region (the window too small) reject the call.

Messages are int64 words on one pipe per (source, destination): a header (sequence number and the agreement's words),
"done" (the source's region of that call was read), "fail" (the source gave the call up and raises EPRankFailure: a
late peer must not complete it either) or "bye" (the source destroyed its Buffer). The pipe's lock makes the rows
written before a message visible to its reader on any CPU; waiting is ``poll`` (no CPU used). A peer that exits is
seen at once (its pipes close), one that hangs at the timeout; the survivors agree on the missing ranks
(:func:`~.failure.agree_missing`). Set up by :func:`~.window_setup.setup`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import struct
import time
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist

from ..errors import ACLNN_ERR_PARAM_INVALID
from .agreement import STATUS_OK, Agreement, Received, Send, WindowTooSmall
from .failure import EPRankFailure, agree_missing
from .group import EPGroup

HEADER, DONE, BYE, FAIL = 1, 2, 3, 4  # message kinds
DATA_OFFSET = 4096  # the first page holds the owner's nonce
STALE = 8  # calls after which an unread header is dropped (a receive is due before the next-but-one call)
DEFAULT_WINDOW_BYTES = 1 << 30
"""Bytes of each rank's window when the caller asks for fewer (pages are allocated when touched)."""

_WORD = struct.Struct("<q")
PeerParts = tuple[torch.Tensor, int, int]  # a peer's window, the pipe to it, the pipe from it


def close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclasses.dataclass
class Call:
    """One call on the window: its sequence number, half (parity), op and issue time (monotonic)."""

    seq: int
    parity: int
    op: str
    started: float


class PeerLost(Exception):
    """A wait of a spanning transport's window failed (a peer on this host exited or hung): the collective part of the
    call finds the missing ranks."""


class _Peer:
    """What this rank holds of one peer: its window (uint8), the pipe to it, the pipe from it, and what it said."""

    def __init__(self, window: torch.Tensor, out_fd: int, in_fd: int) -> None:
        self.window, self.out_fd, self.in_fd = window, out_fd, in_fd
        self.inbox: dict[int, list[int]] = {}  # seq -> header words
        self.abandoned: set[int] = set()  # seqs of calls the peer gave up
        self.done: set[int] = set()  # seqs of this rank's calls the peer has read
        self.written: list[int | None] = [None, None]  # per half: the seq of this rank's last write into the peer
        self.gone = ""  # why the peer is gone ("" while alive): known from its pipe, after its messages
        self.unreachable = False  # writing to the peer failed (it exited; what it sent before is still read)
        self.pending = b""  # the start of a message not read whole


class Window:
    """The window transport of one buffer's group (see the module docstring and :mod:`deep_ep_npu.transports`)."""

    name = "shm"

    def __init__(self, ep: EPGroup, key: int, window: torch.Tensor, peers: dict[int, PeerParts]) -> None:
        self.ep, self.key, self.window, self.seq = ep, key, window, 0
        self.peers = {q: _Peer(*parts) for q, parts in peers.items()}
        self.spanning = False  # part of a :class:`~.spanning.Spanning` transport: failures are agreed there

    def _region_rows(self, owner_bytes: int, row_bytes: int) -> int:
        return (owner_bytes - DATA_OFFSET) // 2 // self.ep.num_ranks // row_bytes

    def region(self, owner: int, call: Call, src: int, row_bytes: int, rows: int) -> torch.Tensor:
        """`[rows, row_bytes]` uint8: the start of ``src``'s region of ``call``'s half in ``owner``'s window."""
        window = self.window if owner == self.ep.rank else self.peers[owner].window
        m = self._region_rows(window.numel(), row_bytes)
        assert rows <= m, "rows checked against the smallest window"
        begin = DATA_OFFSET + call.parity * ((window.numel() - DATA_OFFSET) // 2) + src * m * row_bytes
        return window[begin : begin + rows * row_bytes].view(rows, row_bytes)

    def live_peers(self) -> list[int]:
        """The live ranks of this window (this host's ranks but this one)."""
        return [p for p in self.ep.live if p in self.peers]

    def begin(self, op: str) -> Call:
        self.seq += 1  # (every live rank starts the same calls in the same order)
        return Call(self.seq, self.seq % 2, op, time.monotonic())

    def claim(self, call: Call, dest: int) -> None:
        """Wait (bounded) until ``dest`` has read what this rank wrote into its region of this half two calls ago."""
        peer = self.peers[dest]
        prev, peer.written[call.parity] = peer.written[call.parity], call.seq
        if prev is not None:
            if prev not in peer.done:
                self._wait(call, [dest], lambda p: prev in p.done)
            peer.done = {s for s in peer.done if s > prev}

    def post(self, call: Call, dest: int, words: list[int]) -> None:
        """Send ``dest`` this call's header (after the rows are written: the write releases them)."""
        self._send(self.peers[dest], [HEADER, call.seq, *words])

    def release(self, call: Call) -> None:
        """Tell every live peer that its region of ``call`` was read."""
        for s in self.live_peers():
            self._send(self.peers[s], [DONE, call.seq])

    def send(self, request: Send) -> WindowTicket:
        # (agree_now is the collective transport's: here the headers come with the rows)
        call = self.start(request, self.reject)
        self.write(call, request)
        return WindowTicket(self, call, request)

    def start(self, request: Send, reject: Callable[[str, int, int], None]) -> Call:
        """Begin ``request``'s call; when its rows for a peer exceed the peer's region, ``reject(op, code, width)`` it
        (the peers raise) and raise :class:`~.agreement.WindowTooSmall`."""
        assert request.before_payload is None, "the TP stage runs on the collective transport"
        if err := self.oversized(request):
            reject(request.op, err.code, len(request.shared))
            raise err
        return self.begin(request.op)

    def oversized(self, request: Send) -> WindowTooSmall | None:
        """The error of a call whose rows for a peer of this window exceed its region, or None."""
        row_bytes, counts = request.shared[0], request.counts
        sizes = [self.window.numel(), *(p.window.numel() for p in self.peers.values())]
        limit = min(self._region_rows(s, row_bytes) for s in sizes)  # rows per source in the smallest window
        if not (bad := [(d, counts[d][0]) for d in self.peers if counts[d][0] > limit]):
            return None
        dest, rows = max(bad, key=lambda b: b[1])
        need = DATA_OFFSET + 2 * self.ep.num_ranks * rows * row_bytes
        what = f"{request.op} sends {rows} rows of {row_bytes} bytes to rank {dest}, its window holds {limit}"
        return WindowTooSmall(ACLNN_ERR_PARAM_INVALID, f"{what} per source", need)

    def write(self, call: Call, request: Send) -> None:
        """The send phase of ``call``: each live peer's rows into its region (``request.write(d, out)``), then its
        header."""
        counts, shared = request.counts, request.shared
        for d in self.live_peers():
            self.claim(call, d)
            request.write(d, self.region(d, call, self.ep.rank, shared[0], counts[d][0]))
            self.post(call, d, [STATUS_OK, *counts[d], *shared])

    def receive(self, call: Call, request: Send) -> Received:
        """Wait for the live peers' headers of ``call``, check them, and hand over their rows where they lie."""
        me, live, width = self.ep.rank, self.live_peers(), len(request.counts[0])
        own = [STATUS_OK, *request.counts[me], *request.shared]
        try:
            t0 = time.perf_counter_ns()
            headers = self.wait_headers(call, live)
            wait_ns = time.perf_counter_ns() - t0
            fill = [STATUS_OK] + [0] * (len(own) - 1)  # ranks removed by shrink mode
            rows = [own if s == me else headers.get(s, fill) for s in range(self.ep.num_ranks)]
            agreement = Agreement(
                [w[0] for w in rows],
                [w[1 : 1 + width] for w in rows],
                [tuple(w[1 + width :]) for w in rows],
                wait_ns // 1000,
                call.op,
            )
            request.check(agreement)
        except BaseException:
            self.release(call)
            raise
        row_bytes, masked = own[1 + width], self.ep.mask.tolist()
        parts = [(s, self.region(me, call, s, row_bytes, rows[s][1])) for s in live if not masked[s]]
        return Received(agreement, parts, wait_ns)

    def wait_headers(self, call: Call, ranks: list[int]) -> dict[int, list[int]]:
        """Wait (bounded) for the header of ``call`` from each of ``ranks`` and take them (source -> words)."""
        self._wait(call, ranks, lambda p: call.seq in p.inbox)
        if any(call.seq in self.peers[s].abandoned for s in ranks):  # its data came, but a peer gave the call up
            self._fail(call)  # (it named the missing ranks in the store: learn them there)
        headers = {}
        for s in ranks:  # (headers of calls this rank abandoned are never read: old ones are dropped)
            peer = self.peers[s]
            headers[s] = peer.inbox.pop(call.seq)
            peer.inbox = {q: w for q, w in peer.inbox.items() if q > self.seq - STALE}
        return headers

    def reject(self, op: str, code: int, width: int, call: Call | None = None) -> None:
        """Post headers with status ``code`` and release the call at once: the peers raise, this rank does not wait."""
        call = call or self.begin(op)
        for d in self.live_peers():
            self.claim(call, d)
            self.post(call, d, [code, 0, -1, *([0] * width)])
        self.release(call)

    def _send(self, peer: _Peer, words: list[int]) -> None:
        if peer.gone or peer.unreachable:
            return
        try:  # < PIPE_BUF: atomic; the pipe never holds more than ~2 calls' messages
            os.write(peer.out_fd, struct.pack(f"<{len(words) + 1}q", len(words), *words))
        except OSError:  # the peer exited (broken pipe): its absence is found by the next wait, once the messages
            peer.unreachable = True  # it posted before it exited are read (a peer that rejected a call and left)

    def _pump(self, peer: _Peer) -> None:
        """Read what the peer sent (``poll`` says its pipe is readable)."""
        try:
            data = os.read(peer.in_fd, 1 << 16)
        except OSError as err:
            data, peer.gone = b"", f"its pipe failed ({err.strerror})"
        if not data:
            peer.gone = peer.gone or "it exited (its pipe closed)"
            return
        buf = peer.pending + data
        while len(buf) >= 8 and len(buf) >= 8 * ((n := _WORD.unpack_from(buf)[0]) + 1):  # a whole message
            kind, seq, *rest = struct.unpack_from(f"<{n}q", buf, 8)
            buf = buf[8 * (n + 1) :]
            if kind == HEADER:
                peer.inbox[seq] = rest
            elif kind == DONE:
                peer.done.add(seq)
            elif kind == FAIL:
                peer.abandoned = {q for q in peer.abandoned if q > seq - STALE} | {seq}
            elif kind == BYE:
                peer.gone = "it destroyed its Buffer"
        peer.pending = buf

    def _wait(self, call: Call, ranks: list[int], ready: Callable[[_Peer], bool]) -> None:
        """Pump the pipes of ``ranks`` until ``ready(peer)`` holds for each, at most ``timeout`` seconds."""
        deadline = time.monotonic() + self.ep.timeout
        while waiting := [self.peers[r] for r in ranks if not ready(self.peers[r])]:
            if any(p.gone for p in waiting) or (left := deadline - time.monotonic()) <= 0:
                self._fail(call)
            poller = select.poll()  # (not select(): file descriptors above 1023 are fine)
            for p in waiting:
                poller.register(p.in_fd, select.POLLIN)
            readable = {fd for fd, _ in poller.poll(max(1, int(left * 1000)))}
            for peer in waiting:
                if peer.in_fd in readable:
                    self._pump(peer)

    def _fail(self, call: Call) -> NoReturn:
        ep, timeout = self.ep, self.ep.timeout
        ep.broken = True
        if self.spanning:  # the spanning transport's collective agreement (every rank takes part) finds who is missing
            raise PeerLost(call.op)
        for peer in self.peers.values():  # a late peer whose data for this call is already here must not succeed
            self._send(peer, [FAIL, call.seq])
        heard = {ep.rank} | {s for s, p in self.peers.items() if any(q >= call.seq for q in p.inbox)}
        arrived = {i for i, r in enumerate(ep.live) if r in heard}  # a rank whose header came is waited for
        rank = ep.live.index(ep.rank)
        store = dist.PrefixStore(f"shm/{self.key:x}/", dist.distributed_c10d._get_default_store())
        try:  # keyed by the failures so far, not the call: a peer that got the signal of a rank that died while
            # posting (its call completed) joins at its next call, and every survivor names the same ranks
            key = f"{getattr(ep.comm, 'group_name', '')}/{len(ep.failed)}/window"
            missing = agree_missing(store, rank, len(ep.live), key, call.started, timeout, arrived.__contains__)
        except (RuntimeError, ValueError) as store_err:  # the store itself is gone (its host rank died)
            raise EPRankFailure((), call.op, timeout, unknown=f"store unreachable: {store_err}") from None
        raise EPRankFailure([ep.live[r] for r in missing], call.op, timeout, rank in missing)

    def close(self) -> None:
        """Tell the peers this rank left (their waits fail at once) and close the pipes. Idempotent."""
        for peer in self.peers.values():
            self._send(peer, [BYE, 0])
            close_fds(peer.out_fd, peer.in_fd)
            peer.gone = "this rank closed the window"
        self.peers.clear()  # the peers' windows are unmapped once their tensors are freed


@dataclasses.dataclass(frozen=True)
class WindowTicket:
    """A window call in flight: :meth:`Window.receive`, then :meth:`Window.release` (``done``)."""

    window: Window
    call: Call
    request: Send

    def receive(self) -> Received:
        return self.window.receive(self.call, self.request)

    def done(self) -> None:
        self.window.release(self.call)
