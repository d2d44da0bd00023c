"""Setting up the shared-memory windows of a group's ranks (:func:`create` / :func:`setup`, collective): each rank
creates its window (``memfd_create``: no name anywhere), binds an abstract unix socket (no file), exchanges its name
through the group, sends each peer its window and the write end of a new pipe (``SCM_RIGHTS``), and checks the nonce
each peer wrote at the start of its window. The first agreement also carries each rank's host key (:mod:`.hosts`):
windows join the ranks of one host only (ranks on other hosts, or network namespaces, could not reach the sockets
anyway); a failed exchange is seen by some rank and every rank learns it in the closing agreement. The windows' use:
:mod:`.window`."""

from __future__ import annotations

import array
import mmap
import os
import select
import socket
import struct
import time

import torch

from .agreement import STATUS_OK
from .group import EPGroup
from .hosts import host_groups, host_key
from .window import PeerParts, Window, close_fds


def create(ep: EPGroup, nbytes: int, required: bool) -> Window | None:
    """The window transport of ``ep``'s ranks (collective; see :func:`setup`), or None."""
    parts = setup(ep, nbytes, required)
    return None if parts is None else Window(ep, *parts)


def setup(ep: EPGroup, nbytes: int, required: bool) -> tuple[int, torch.Tensor, dict[int, PeerParts]] | None:
    """The parts of ``ep``'s window transport (collective, bounded by ``ep.timeout``; ``nbytes`` per rank): its key,
    this rank's window and those of its peers on this host, or None when this rank has no such peer or some rank
    cannot share memory with its host's (ValueError if ``required`` and the ranks are not all on one host)."""

    def agree(ok: bool, *words: int) -> list[tuple[int, ...]]:
        """Every rank's ``(ok, *words)``."""
        return ep.start_agree("shm window", STATUS_OK, [[]] * ep.num_ranks, [int(ok), *words])().shared

    me, sock, exchange, token = ep.rank, None, None, int.from_bytes(os.urandom(7), "little")
    why = "needs Linux (memfd_create, SCM_RIGHTS)"
    if hasattr(os, "memfd_create") and hasattr(socket, "recv_fds"):
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(_address(token))
            sock.setblocking(False)
            why = ""
        except OSError as err:
            why = f"cannot bind a unix socket: {err}"
    first = agree(not why, token, nbytes, host_key())
    tokens, hosts = [fp[1] for fp in first], host_groups([fp[3] for fp in first])
    local = next(h for h in hosts if me in h)
    if required and len(hosts) > 1:
        if sock is not None:
            sock.close()
        raise ValueError(
            f"transport: 'shm' needs every rank on one host; the ranks are on {len(hosts)} hosts "
            f"{hosts}; pass transport='auto' (the window within each host) or 'collective'"
        )
    if all(len(h) == 1 for h in hosts):
        why = "every rank is alone on its host"
    elif all(fp[0] for fp in first):
        assert sock is not None
        try:
            exchange = _Exchange(sock, me, local, tokens, [fp[2] for fp in first])
            exchange.send(ep.timeout)
        except (OSError, ValueError) as err:
            why = f"rank {me} could not send its window to its peers: {err}"
    elif not why:
        why = "a peer cannot use shared memory: " + ", ".join(f"rank {i}" for i, fp in enumerate(first) if not fp[0])
    sent = all(fp[0] for fp in agree(not why))
    if not why and sent and exchange is not None:  # every window is on its way
        try:
            exchange.receive(ep.timeout)
        except (OSError, ValueError) as err:
            why = f"rank {me} could not map its peers' windows: {err}"
    elif not why:
        why = "a peer could not send its window"
    if sock is not None:
        sock.close()
    ok = [fp[0] for fp in agree(not why)]
    if exchange is not None:
        exchange.close(keep=all(ok))
        if all(ok) and exchange.peers:
            return tokens[local[0]], exchange.window, exchange.peers
    if required:
        bad = [i for i, k in enumerate(ok) if not k]
        raise ValueError(
            f"transport: 'shm' needs every rank on one host with shared memory; ranks {bad} cannot "
            f"({why or 'see those ranks'}); pass transport='auto' or 'collective'"
        )
    return None


def _address(token: int) -> bytes:
    return f"\0deep_ep_npu.window.{token:x}".encode()


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The shared mapping of ``fd`` as uint8 (the tensor holds the mapping: it is unmapped when the tensor is freed)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), dtype=torch.uint8)


class _Exchange:
    """This rank's window, sent with a pipe's write end to every peer (:meth:`send`), then the peers' windows mapped
    and checked (:meth:`receive`)."""

    def __init__(self, sock: socket.socket, me: int, local: list[int], tokens: list[int], sizes: list[int]) -> None:
        self.sock, self.me, self.local, self.tokens, self.sizes = sock, me, local, tokens, sizes
        self.fd = os.memfd_create("deep_ep_npu.window", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, sizes[me])
        self.window = _map(self.fd, sizes[me])
        self.window[:8].copy_(torch.tensor([tokens[me]], dtype=torch.int64).view(torch.uint8))
        self.in_fds: dict[int, int] = {}
        self.outbox: list[tuple[int, int]] = []  # (peer, the write end of its pipe) not sent yet
        for q in local:
            if q != me:
                self.in_fds[q], wr = os.pipe()
                self.outbox.append((q, wr))
        self.peers: dict[int, PeerParts] = {}

    def send(self, timeout: float) -> None:
        """Send to every peer (receiving meanwhile: a socket's queue holds few messages). Raises OSError when a peer
        cannot be reached (another host), ValueError past ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.outbox:
            q, wr = self.outbox[0]
            try:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd, wr]))]
                self.sock.sendmsg(
                    [struct.pack("<qq", self.me, self.tokens[self.me])], ancillary, 0, _address(self.tokens[q])
                )
                os.close(wr)
                self.outbox.pop(0)
            except BlockingIOError:
                self._receive_one(deadline, 0.01)

    def receive(self, timeout: float) -> None:
        """Map every peer's window (all peers have sent: their messages are queued). Raises ValueError when one is
        missing or wrong."""
        deadline = time.monotonic() + timeout
        while len(self.peers) < len(self.local) - 1:
            self._receive_one(deadline, deadline - time.monotonic())
        for _, out_fd, in_fd in self.peers.values():
            os.set_blocking(in_fd, False)
            os.set_blocking(out_fd, True)

    def _receive_one(self, deadline: float, wait: float) -> None:
        if time.monotonic() > deadline:
            raise ValueError("the window exchange did not finish in time")
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 64, 2)
        except BlockingIOError:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            poller.poll(max(1, int(wait * 1000)))
            return
        q, token = struct.unpack("<qq", msg)
        if len(fds) != 2 or q not in self.local or q == self.me or token != self.tokens[q]:
            raise ValueError(f"unexpected window message from rank {q}")
        their = _map(fds[0], self.sizes[q])
        os.close(fds[0])
        if int(their[:8].view(torch.int64)[0]) != self.tokens[q]:
            raise ValueError(f"rank {q}'s window does not hold its nonce: not shared memory")
        self.peers[q] = (their, fds[1], self.in_fds[q])

    def close(self, keep: bool) -> None:
        """Close this rank's window file (its mapping stays) and, unless ``keep``, every pipe end of the exchange."""
        pipes = [*self.in_fds.values(), *(p[1] for p in self.peers.values()), *(wr for _, wr in self.outbox)]
        close_fds(self.fd, *([] if keep else pipes))
