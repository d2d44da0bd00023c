"""A shared-memory communication window for the ranks of one host: the shm transport's memory and signals.

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
(:class:`~deep_ep_npu.failure.GroupMonitor`, under its own key prefix) and raise
:class:`~deep_ep_npu.failure.EPRankFailure`.

The windows are set up collectively by :func:`~.window_setup.create_window` (same-host check included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import select
import struct
import time

import torch
import torch.distributed as dist

from ..failure import EPRankFailure, GroupMonitor
from ..group import EPGroup

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


class ShmWindow:
    """The window and signals of one Buffer's group (see the module docstring). Built by
    :func:`~.window_setup.create_window`."""

    def __init__(self, ep: EPGroup, key: int, window: torch.Tensor, mm: mmap.mmap, peers: dict[int, _Peer]) -> None:
        self.ep, self.key, self.nbytes, self.window, self._mm, self.peers = ep, key, window.numel(), window, mm, peers
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

    def own_regions(self, call: Call, row_bytes: int) -> tuple[torch.Tensor, int]:
        """This rank's half of ``call`` as `[R * m, row_bytes]` uint8 (source ``s``'s rows from ``s * m`` on), and m."""
        m = self._region_rows(self.nbytes, row_bytes)
        half = (self.nbytes - DATA_OFFSET) // 2
        begin = DATA_OFFSET + call.parity * half
        return self.window[begin : begin + self.ep.num_ranks * m * row_bytes].view(-1, row_bytes), m

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

    def reject(self, op: str, code: int, words: int) -> None:
        """This rank rejected its input of ``op``: post headers with status ``code`` (``words`` zero words after it)
        and release the call at once. The peers raise on reading them; this rank does not wait."""
        call = self.begin(op)
        for d in self.live_peers():
            self.claim(call, d)
            self.post(call, d, [code, *([0] * words)])
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

    def _fail(self, call: Call, timeout: float) -> None:
        ep = self.ep
        for peer in self.peers.values():  # a late peer whose data for this call is already here must not succeed
            self._send(peer, [FAIL, call.seq])
        heard = {ep.rank} | {s for s, p in self.peers.items() if any(q >= call.seq for q in p.inbox)}
        mon = _Monitor(ep.comm, {i for i, r in enumerate(ep.live) if r in heard})
        mon.store = dist.PrefixStore(f"shm/{self.key:x}/", mon.store)  # the window's own agreements
        try:  # keyed by the failures so far, not the call: a peer that got the signal of a rank that died while
            # posting (its call completed) joins at its next call, and every survivor names the same ranks
            missing = mon.agree(len(ep.failed), "window", call.started, timeout)
        except (RuntimeError, ValueError) as store_err:  # the store itself is gone (its host rank died)
            raise EPRankFailure((), call.op, timeout, unknown=f"store unreachable: {store_err}") from None
        raise EPRankFailure([ep.live[r] for r in missing], call.op, timeout, mon.rank in missing)

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


class _Monitor(GroupMonitor):
    """The failure agreement of a window call: a rank has arrived at the call when its header reached this rank
    (the window's calls set no arrival marks in the store); such a rank is waited for until it posts alive."""

    def __init__(self, group: dist.ProcessGroup, arrived: set[int]) -> None:
        super().__init__(group)
        self.arrived = arrived

    def _arrived(self, rank: int, seq: int, op: str) -> bool:
        return rank in self.arrived


def _close_fds(peer: _Peer) -> None:
    for fd in (peer.out_fd, peer.in_fd):
        with contextlib.suppress(OSError):
            os.close(fd)
