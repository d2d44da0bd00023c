"""The types a transport takes and returns: what one call sends (:class:`Send`: the rows' writer :data:`Write` and the
check every rank runs on the agreement before a row is read, :data:`Check`), what the agreement step tells a rank
(:class:`Agreement`), what the receive hands over (:class:`Received`) through the send's :class:`Ticket`, and the
errors of a call a transport cannot carry (:class:`TransportError`). The agreement step itself:
:meth:`.group.EPGroup.start_agree` (the collective transport, the ops, the TP stage) or the window's headers
(:mod:`.window`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

STATUS_OK = 0  # an agreement row's status when the rank accepted its input (else the aclnn code it raised)


@dataclasses.dataclass
class Agreement:
    """What every source rank announced to this rank in one agreement step (lists indexed by source rank): its status
    (0, or the aclnn code of its rejected input), its words for this rank, its shared words, and the wait (µs)."""

    status: list[int]
    counts: list[list[int]]
    shared: list[tuple[int, ...]]
    wait_us: int
    op: str


Write = Callable[[int, torch.Tensor], None]  # write(d, out): the rows for rank d into out [rows, row_bytes] uint8
Check = Callable[[Agreement], None]


@dataclasses.dataclass(frozen=True)
class Send:
    """One call, on every rank: ``counts[d]``, the header words for rank d (``counts[d][0]`` the rows this rank writes
    for it, ``counts[d][1]`` the rows it expects from it when already known, else -1); ``shared``, the words for every
    rank (``shared[0]`` the row size in bytes); ``write`` and ``check`` (raises, the same error on every rank, before
    any received row is used); ``agree_now``: the collective transport checks the agreement in the send phase;
    ``before_payload``: a TP stage (collective transport only) run between the agreement and the payload, True when
    it changed the rows (written again); ``device``: the rows' (None: the group's)."""

    op: str
    counts: list[list[int]]
    shared: list[int]
    write: Write
    check: Check
    agree_now: bool = False
    before_payload: Callable[[], bool] | None = None
    device: torch.device | None = None


@dataclasses.dataclass(frozen=True)
class Received:
    """A call's receive: the checked agreement, ``parts`` (source rank, its rows `[n, row_bytes]` uint8) in source
    order, and the wait for the peers in ns."""

    agreement: Agreement
    parts: list[tuple[int, torch.Tensor]]
    wait_ns: int


class Ticket(Protocol):
    """A sent call: :meth:`receive` once (it raises the check's error, or :class:`TransportError`, on every rank), then
    :meth:`done` once the parts were read."""

    def receive(self) -> Received: ...
    def done(self) -> None: ...


class TransportError(Exception):
    """A call the transport cannot carry, raised alike on every rank; ``code``: the aclnn status its peers were told.
    The caller names the parameter that fixes it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class WindowTooSmall(TransportError):
    """A call's rows for a peer exceed its region of the shared-memory window; ``need``: the bytes per rank a window
    needs to carry them."""

    def __init__(self, code: int, message: str, need: int) -> None:
        super().__init__(code, message)
        self.need = need


class EarlyMismatch(TransportError):
    """Some ranks knew the rows they receive (their payload started before the agreement) and others did not."""
