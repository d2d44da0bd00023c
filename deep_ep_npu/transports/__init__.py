"""How rows move between the ranks of an EP group: a :class:`Transport` moves bytes and signals and nothing else;
which rows go where and what the header words mean is the engine's (:mod:`deep_ep_npu.engine.exchange`). Both
transports give bit-identical results: :class:`~.collective.Collective` (torch.distributed: on gloo one all-to-all
of each rank's headers and rows; elsewhere, :mod:`.staged`, one of the headers, then one of the rows) and
:class:`~.window.Window` (a shared-memory window of the ranks of one host: rows written straight into the receivers'
windows, headers sent on pipes; the send phase waits for no peer). A group on
several hosts (:mod:`.hosts`) with peers on this one uses both in the same call: :class:`~.spanning.Spanning`.

One call, on every rank (:class:`~.agreement.Send`: the header words for each rank, the words shared by all, the
rows' writer and the agreement's check)::

    ticket = transport.send(Send(op, counts, shared, write, check))  # write(d, out): d's rows into out
    received = ticket.receive()  # the checked agreement, parts: (source, its rows [n, row_bytes] uint8), wait
    ticket.done()                # the parts were read

``check(agreement)`` raises (the same error on every rank) before any received row is used; a rank that rejected its
input calls ``transport.reject(op, code, width)`` instead (``width``: the shared words), so the others raise too. A
call a transport cannot carry raises :class:`~.agreement.TransportError` on every rank; the caller names the
parameter that fixes it.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from .. import envs
from . import window, window_setup
from .agreement import Send, Ticket
from .collective import Collective
from .group import EPGroup
from .spanning import Spanning
from .staged import Staged

TRANSPORTS = ("auto", "shm", "collective")


class Transport(Protocol):
    """Moves rows and header words (see the module docstring); ``name``: ``"collective"``, ``"shm"`` or
    ``"spanning"``."""

    name: str

    def send(self, request: Send) -> Ticket: ...
    def reject(self, op: str, code: int, width: int) -> None: ...
    def close(self) -> None: ...


def resolve_transport_name(name: str | None) -> str:
    """``name``, else ``DEEP_EP_NPU_TRANSPORT``, else ``"auto"``; ValueError outside :data:`TRANSPORTS`."""
    if name is None:
        name = envs.transport() or "auto"
    if name not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {list(TRANSPORTS)}, got {name!r}")
    return name


def create(ep: EPGroup, name: str, window_bytes: int, reuse: bool) -> tuple[Collective, Transport | None]:
    """The collective transport of ``ep`` (one round on a gloo group, else :mod:`.staged`; ``reuse``: its buffers
    alternate between two reused sets, else each call gets its own) and, for ``name`` ``"auto"`` / ``"shm"`` on a
    gloo group, its window transport (collective; ``window_bytes`` per rank, at least
    :data:`~.window.DEFAULT_WINDOW_BYTES`): the window when every rank is on this host, a :class:`Spanning` one when
    the group spans hosts and this one holds a peer ("auto" only; "shm" raises ValueError), else None."""
    collective = Collective(ep, reuse, staged=Staged(ep, reuse))
    if name == "collective" or ep.num_ranks == 1:
        return collective, None
    backend = str(dist.get_backend(ep.group)).lower()
    if "gloo" not in backend:
        if name == "shm":
            raise ValueError(f"transport: 'shm' needs a gloo (CPU) group, got backend {backend!r}; pass 'auto'")
        return collective, None
    nbytes = max(window_bytes, window.DEFAULT_WINDOW_BYTES)
    win = window_setup.create(ep, nbytes, required=name == "shm")
    if win is None or len(win.peers) == ep.num_ranks - 1:
        return collective, win
    local = frozenset(win.peers)
    return collective, Spanning(win, Collective(ep, reuse, local, Staged(ep, reuse, local)))
