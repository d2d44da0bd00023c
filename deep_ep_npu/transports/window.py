"""The window transport: a shared-memory communication window for the ranks of one host, its memory and signals.

Each rank owns one window, an anonymous shared-memory file (``memfd_create``: it has no name in ``/dev/shm`` or
anywhere else, so nothing can leak, even after a crash; the kernel frees it when the last process that maps it
exits). The window holds two halves (call parity: calls alternate between them, so a result a peer still reads is
never overwritten by the next call), each cut into one region per source rank: source ``s`` writes the rows of a call
for this rank into region ``s`` of the call's half.

Signals are messages on one pipe per (source, destination) pair. A message is a few int64 words: a header (the call's
sequence number, op, validation status, counts and fingerprint: everything the agreement step carries, in-band), a
"done" (the destination has read the source's region of that call, which may now be reused), "fail" (the source gave
the call up: it raises EPRankFailure, so a late peer that finds all its data must not complete the call either) or
"bye" (the source destroyed its Buffer). A pipe write and read are system calls that take the pipe's lock in the
kernel: the writer's earlier stores (the rows) are released before the message is visible, the reader acquires them
before it reads the rows, on any CPU (aarch64 included). Waiting is ``poll`` on the pipes: a blocked rank uses no
CPU. A peer that exits closes its pipes, so its death is seen at once (end of file, after the messages it sent); a
peer that hangs is found at the timeout. Either way the survivors agree on the missing ranks through the c10d store
(:func:`~.failure.agree_missing`, under its own key prefix) and raise :class:`~.failure.EPRankFailure`.

Send phase (:meth:`Window.send`): for each live peer, the rows for that peer are written straight into its window
(its region for this rank, in the call's half), then the peer gets the header. No count round trip, nothing waited
for: a peer that has not called yet reads it all later. Receive phase: wait (bounded) for every live peer's header,
check them (every rank sees the same headers, so every rank raises the same error), hand the rows over where they
are, then tell each peer its region was read. A rank whose rows for a peer exceed the region (``num_rdma_bytes`` too
small) rejects the call: it posts that status and raises; its peers raise on reading it.

The windows are set up collectively by :func:`create` (:mod:`.window_setup`: the same-host check included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import select
import struct
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import invalid
from .collective import STATUS_OK, Agreement, EPGroup
from .failure import EPRankFailure, agree_missing

HEADER, DONE, BYE, FAIL = 1, 2, 3, 4  # message kinds
DATA_OFFSET = 4096  # the first page holds the owner's nonce
STALE = 8  # calls after which an unread header is dropped (a receive is due before the next-but-one call)
DEFAULT_WINDOW_BYTES = 1 << 30
"""Bytes of each rank's window when the Buffer's ``num_rdma_bytes`` is smaller (pages are allocated when touched)."""

_WORD = struct.Struct("<q")


@dataclasses.dataclass
class Call:
    """One call on the window: its sequence number, half (parity), op and issue time (monotonic)."""

    seq: int
    parity: int
    op: str
    started: float


class _Peer:
    """What this rank holds of one peer: its window (a uint8 tensor), the pipe to it and the pipe from it."""

    def __init__(self, rank: int, window: torch.Tensor, mm: mmap.mmap, out_fd: int, in_fd: int) -> None:
        self.rank, self.window, self.mm, self.out_fd, self.in_fd = rank, window, mm, out_fd, in_fd
        self.inbox: dict[int, list[int]] = {}  # seq -> header words
        self.abandoned: set[int] = set()  # seqs of calls the peer gave up (it raised EPRankFailure for them)
        self.done: set[int] = set()  # seqs of this rank's calls the peer has read
        self.written: list[int | None] = [None, None]  # per half: the seq of this rank's last write into the peer
        self.gone = ""  # why the peer is gone ("" while alive): known from its pipe to this rank, after its messages
        self.unreachable = False  # writing to the peer failed (it exited; what it sent before is still read)
        self.pending = b""


class Window:
    """The window and signals of one buffer's group: the window transport (see the module docstring and
    :mod:`deep_ep_npu.transports`). Built by :func:`~.window_setup.setup`."""

    name = "shm"

    def __init__(self, ep: EPGroup, key: int, window: torch.Tensor, mm: mmap.mmap,
                 peers: dict[int, tuple[torch.Tensor, mmap.mmap, int, int]]) -> None:  # fmt: skip
        self.ep, self.key, self.nbytes, self.window, self._mm = ep, key, window.numel(), window, mm
        self.peers = {q: _Peer(q, *parts) for q, parts in peers.items()}
        self.seq = 0
        self.closed = False

    # -- geometry ----------------------------------------------------------------------------------------------
    def _region_rows(self, owner_bytes: int, row_bytes: int) -> int:
        return (owner_bytes - DATA_OFFSET) // 2 // self.ep.num_ranks // row_bytes

    def rows_per_region(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` a source may write into a peer's region in one call (the smallest window)."""
        sizes = [self.nbytes, *(p.window.numel() for p in self.peers.values())]
        return min(self._region_rows(s, row_bytes) for s in sizes)

    def region(self, owner: int, call: Call, src: int, row_bytes: int, rows: int) -> torch.Tensor:
        """`[rows, row_bytes]` uint8: rows ``[0, rows)`` of source ``src``'s region in ``owner``'s window (this rank
        or a peer) in ``call``'s half."""
        window = self.window if owner == self.ep.rank else self.peers[owner].window
        m = self._region_rows(window.numel(), row_bytes)
        assert rows <= m, "rows checked against rows_per_region"
        half = (window.numel() - DATA_OFFSET) // 2
        begin = DATA_OFFSET + call.parity * half + src * m * row_bytes
        return window[begin : begin + rows * row_bytes].view(rows, row_bytes)

    # -- calls -------------------------------------------------------------------------------------------------
    def begin(self, op: str) -> Call:
        """Start a call (every live rank starts the same calls in the same order)."""
        self.seq += 1
        return Call(self.seq, self.seq % 2, op, time.monotonic())

    def live_peers(self) -> list[int]:
        return [p for p in self.ep.live if p != self.ep.rank]

    def claim(self, call: Call, dest: int) -> None:
        """Wait (bounded) until ``dest`` has read what this rank wrote into its region of this half two calls ago
        (immediate unless ``dest`` is two calls behind); then ``dest``'s region is this call's to write."""
        peer = self.peers[dest]
        prev, peer.written[call.parity] = peer.written[call.parity], call.seq
        if prev is not None and prev not in peer.done:
            self._wait(call, [dest], lambda p: prev in p.done)
        peer.done = {s for s in peer.done if s > prev} if prev is not None else peer.done

    def post(self, call: Call, dest: int, words: list[int]) -> None:
        """Send ``dest`` this call's header (after the rows are written: the write releases them)."""
        self._send(self.peers[dest], [HEADER, call.seq, *words])

    def wait_headers(self, call: Call) -> tuple[dict[int, list[int]], int]:
        """The headers of ``call`` from every live peer, and the nanoseconds waited. Raises EPRankFailure (missing
        ranks agreed through the store) when a peer is gone or silent past the timeout."""
        t0 = time.perf_counter_ns()
        live = self.live_peers()
        self._wait(call, live, lambda p: call.seq in p.inbox)
        if any(call.seq in self.peers[s].abandoned for s in live):  # its data came, but a peer gave the call up
            self._fail(call, self.ep.timeout)  # (it named the missing ranks in the store: learn them there)
        got = {s: self.peers[s].inbox.pop(call.seq) for s in live}
        for s in live:  # headers of calls this rank abandoned (rejected, re-run) are never read: drop old ones
            peer = self.peers[s]
            peer.inbox = {q: w for q, w in peer.inbox.items() if q > self.seq - STALE}
        return got, time.perf_counter_ns() - t0

    def release(self, call: Call) -> None:
        """Tell every live peer that its region of ``call`` was read (it may reuse it)."""
        for s in self.live_peers():
            self._send(self.peers[s], [DONE, call.seq])

    # -- the transport ----------------------------------------------------------------------------------------
    def send(self, op: str, counts: list[list[int]], shared: list[int], write: Callable[[int, torch.Tensor], None],
             check: Callable[[Agreement], None], *, agree_now: bool = False,
             before_payload: Callable[[], bool] | None = None, device: torch.device | None = None) -> Any:  # fmt: skip
        """Write each live peer's rows into its window and post its header (``agree_now`` / ``before_payload`` are
        the collective transport's: here the headers come with the rows)."""
        assert before_payload is None, "the TP stage runs on the collective transport"
        call, me, row_bytes = self.begin(op), self.ep.rank, shared[0]
        limit = self.rows_per_region(row_bytes)
        if bad := [(d, c[0]) for d, c in enumerate(counts) if d != me and c[0] > limit]:
            dest, rows = max(bad, key=lambda b: b[1])
            need = DATA_OFFSET + 2 * self.ep.num_ranks * rows * row_bytes
            what = f"{op} sends {rows} rows of {row_bytes} bytes to rank {dest}, its window holds {limit}"
            err = invalid("num_rdma_bytes", f"{what} per source; pass num_rdma_bytes >= {need} (shared-memory window)")
            self.reject(op, err.code, len(shared), call)
            raise err
        for d in self.live_peers():
            self.claim(call, d)
            write(d, self.region(d, call, me, row_bytes, counts[d][0]))
            self.post(call, d, [STATUS_OK, *counts[d], *shared])
        return call, check, [STATUS_OK, *counts[me], *shared], len(counts[0])

    def receive(self, token: Any) -> tuple[Agreement, list[tuple[int, torch.Tensor]], int]:
        """Wait (bounded) for every live peer's header, check them, and return its rows where they are."""
        call, check, own, width = token
        try:
            headers, wait_ns = self.wait_headers(call)
            fill = [STATUS_OK] + [0] * (len(own) - 1)  # ranks removed by shrink mode
            rows = [own if s == self.ep.rank else headers.get(s, fill) for s in range(self.ep.num_ranks)]
            agreement = Agreement([w[0] for w in rows], [list(w[1 : 1 + width]) for w in rows],
                                  [tuple(w[1 + width :]) for w in rows], wait_ns // 1000, call.op)  # fmt: skip
            check(agreement)
        except BaseException:
            self.release(call)
            raise
        row_bytes, masked = own[1 + width], self.ep.mask.tolist()
        parts = [(s, self.region(self.ep.rank, call, s, row_bytes, rows[s][1]))
                 for s in self.live_peers() if not masked[s]]  # fmt: skip
        return agreement, parts, wait_ns

    def done(self, token: Any) -> None:
        self.release(token[0])

    def reject(self, op: str, code: int, width: int, call: Call | None = None) -> None:
        """This rank rejected its input of ``op``: post headers with status ``code`` (zero counts and ``width``
        shared words) and release the call at once. The peers raise on reading them; this rank does not wait."""
        call = call or self.begin(op)
        for d in self.live_peers():
            self.claim(call, d)
            self.post(call, d, [code, 0, -1, *([0] * width)])
        self.release(call)

    # -- messages ----------------------------------------------------------------------------------------------
    def _send(self, peer: _Peer, words: list[int]) -> None:
        if peer.gone or peer.unreachable:
            return
        data = struct.pack(f"<{len(words) + 1}q", len(words), *words)
        try:
            os.write(peer.out_fd, data)  # < PIPE_BUF: atomic; the pipe never holds more than ~2 calls' messages
        except OSError:  # the peer exited (broken pipe): its absence is found by the next wait, once the messages
            peer.unreachable = True  # it posted before it exited are read (a peer that rejected a call and left)

    def _pump(self, peer: _Peer) -> None:
        """Read what the peer sent (non-blocking: called when ``poll`` says the pipe is readable)."""
        try:
            data = os.read(peer.in_fd, 1 << 16)
        except OSError as err:
            data, peer.gone = b"", f"its pipe failed ({err.strerror})"
        if not data:
            peer.gone = peer.gone or "it exited (its pipe closed)"
            return
        buf = peer.pending + data
        while len(buf) >= 8:
            (n,) = _WORD.unpack_from(buf)
            if len(buf) < 8 * (n + 1):
                break
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

    def _wait(self, call: Call, ranks: list[int], ready) -> None:
        """Pump the pipes of ``ranks`` until ``ready(peer)`` holds for each, at most ``timeout`` seconds."""
        deadline, timeout = time.monotonic() + self.ep.timeout, self.ep.timeout
        while True:
            waiting = [self.peers[r] for r in ranks if not ready(self.peers[r])]
            if not waiting:
                return
            if any(p.gone for p in waiting) or (left := deadline - time.monotonic()) <= 0:
                break
            poller = select.poll()  # (not select(): file descriptors above 1023 are fine)
            for p in waiting:
                poller.register(p.in_fd, select.POLLIN)
            readable = {fd for fd, _ in poller.poll(max(1, int(left * 1000)))}
            for peer in waiting:
                if peer.in_fd in readable:
                    self._pump(peer)
        self._fail(call, timeout)

    def _fail(self, call: Call, timeout: float) -> NoReturn:
        ep = self.ep
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

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the peers this rank left (their waits fail at once) and close the pipes. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for peer in self.peers.values():
            self._send(peer, [BYE, 0])
            _close_fds(peer)
            peer.gone = "this rank closed the window"
        self.peers.clear()  # the peers' windows are unmapped once their tensors are freed


def _close_fds(peer: _Peer) -> None:
    for fd in (peer.out_fd, peer.in_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def create(ep: EPGroup, nbytes: int, required: bool) -> Window | None:
    """The window transport of ``ep``'s ranks (collective; ``nbytes`` per rank), or None when some rank cannot share
    memory with the others (then ValueError if ``required``): :func:`~.window_setup.setup`."""
    from .window_setup import setup

    made = setup(ep, nbytes, required)
    return None if made is None else Window(ep, *made)
