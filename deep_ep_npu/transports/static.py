"""The collective transport's static round (:func:`send`): each rank sends every live rank (itself included) one
message of a size known from the call's shapes alone, ``rows`` rows of ``row_bytes`` at fixed offsets after the header
words of :class:`~.collective.Collective`'s one round (status, no spill, ``rows``, -1, the shared words, the first
vector word per destination filled on the device), and the receive checks every header on the device, so that no
tensor value is read back to the host: what a DeepEP-style caller captures in a graph. On gloo, receives are posted at
:func:`~.early.early_bytes` per peer as the one round's, so a peer that rejected its input (a header only) or that took
the one round (its rows and its counts) lands, and its header fails the check. On other groups (NCCL / HCCL: exact-size
receives) every message has the static size; a rank that rejects its input while its peers run the static round of an
op sends every rank a message of that op's last static size whose status word is the code (:func:`reject`). The header
template and the compared words are built once per shape.

The check compares each live source's header with this rank's own (``care`` picks the words compared) and runs the
caller's ``consistent(headers)`` (a bool tensor: the vector words disagree). A mismatch raises through
:func:`torch._assert_async`: on CPU at once, where ``explain(agreement)`` (the header words read back: the error path
only) raises the layout's own error, the same on every rank; on a device at the device's next synchronisation."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from .agreement import STATUS_OK, Agreement
from .collective import _HEAD, Collective

VECTOR = _HEAD + 3  # the header word of the first vector word (after status, spill, the two counts, the row size)
Write = Callable[[torch.Tensor], None]  # write(out): every destination's rows into out [R, rows, row_bytes]
Explain = Callable[[Agreement], None]
Receive = Callable[[], tuple[list[torch.Tensor], int]]
_LAST: weakref.WeakKeyDictionary[Collective, dict[str, tuple[int, torch.device]]] = weakref.WeakKeyDictionary()
"""Per collective transport and op: the last static round's message size and device (for :func:`reject`)."""


@functools.lru_cache(maxsize=64)
def care(num_words: int, skip: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`[num_words]` bool: the header words compared with this rank's own (all but ``skip``), once per shape."""
    out = torch.ones((num_words,), dtype=torch.bool)
    out[list(skip)] = False
    return out.to(device)


@functools.lru_cache(maxsize=64)
def _template(rows: int, shared: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`[words]` int64: the header words of a static message (once per shape: no host-to-device copy per call)."""
    return torch.tensor([STATUS_OK, 0, rows, -1, *shared], dtype=torch.int64, device=device)


def fits(coll: Collective, rows_bytes: int, shared_words: int) -> bool:
    """Whether a static message of ``rows_bytes`` of rows after the header (``shared_words`` shared words) fits the
    receive each peer posts: on gloo :func:`~.early.early_bytes`, elsewhere its exact size (always)."""
    return not coll.early_bytes or 8 * (_HEAD + 2 + shared_words) + rows_bytes <= coll.early_bytes


def send(
    coll: Collective,
    op: str,
    rows: int,
    shared: Sequence[int],
    write: Write,
    care: torch.Tensor,
    vector: torch.Tensor | None,
    inconsistent: Callable[[torch.Tensor], torch.Tensor] | None,
    explain: Explain,
    device: torch.device,
) -> Receive:
    """Start the static round of ``op``: ``write(out)`` fills the rows, ``vector`` `[n]` int64 (or None) the first n
    vector words (after the row size) of every message; ``care`` `[words]` bool: the header words compared with this
    rank's own, ``inconsistent(headers)`` (or None): a bool tensor, True when the headers `[R, words]` int64 disagree
    in a way the comparison cannot see. Returns ``receive() -> (parts, wait_ns)``: each source's rows
    `[rows, row_bytes]` uint8 (R of them, in rank order) once the headers passed the check."""
    ep, me, row_bytes = coll.ep, coll.ep.rank, shared[0]
    assert ep.live == list(range(ep.num_ranks)), "no shrink mode on the static round"
    coll._flip ^= 1
    tag, num_words = coll._flip, _HEAD + 2 + len(shared)
    head, r = 8 * num_words, ep.num_ranks
    size = head + rows * row_bytes
    send_buf = coll._buffer(f"static{tag}", r * size, device).view(r, size)
    words = _template(rows, tuple(shared), device)
    header = send_buf[:, :head].view(torch.int64)
    header.copy_(words.expand(r, num_words))
    if vector is not None:
        header[:, VECTOR : VECTOR + vector.numel()] = vector
    write(send_buf[:, head:].view(r, rows, row_bytes))
    posted = [size if s == me or not coll.early_bytes else coll.early_bytes for s in range(r)]  # (gloo: bounded)
    _LAST.setdefault(coll, {})[op] = (size, device)
    recv = coll._buffer(f"static_recv{tag}", sum(posted), device)
    started = time.perf_counter_ns()
    pending = ep.all_to_all(recv, send_buf.view(-1), posted, [size] * r, op) if r > 1 else None
    if pending is None:
        recv.copy_(send_buf.view(-1))

    def receive() -> tuple[list[torch.Tensor], int]:
        if pending is not None:
            ep.wait(pending, op)
        wait_ns = time.perf_counter_ns() - started
        at = [sum(posted[:s]) for s in range(r)]
        got = torch.stack([recv[a : a + head].view(torch.int64) for a in at])
        bad = ((got != header[me]) & care).any()
        if inconsistent is not None:
            bad |= inconsistent(got)
        try:
            torch._assert_async(~bad, f"{op}: a peer rejected its input or disagrees on the call (header)")
        except RuntimeError:  # (CPU: raised at once; the error path reads the headers to say which)
            explain(agreement_of(op, got, wait_ns))
            raise
        return [recv[a + head : a + size].view(rows, row_bytes) for a in at], wait_ns

    return receive


def reject(coll: Collective, op: str, code: int) -> bool:
    """On a group of exact-size receives (not gloo), send every rank a message of ``op``'s last static size (its
    peers run that round again) whose status word is ``code``; False (nothing sent) on gloo, whose bounded receives
    take the one round's rejection, or when ``op`` never took the static round here."""
    last = _LAST.get(coll, {}).get(op)
    if coll.early_bytes or last is None:
        return False
    (size, device), ep = last, coll.ep
    send = torch.zeros((ep.num_ranks, size), dtype=torch.uint8, device=device)
    send[:, :8].view(torch.int64).fill_(code)
    recv = torch.empty_like(send)
    ep.wait(ep.all_to_all(recv.view(-1), send.view(-1), [size] * ep.num_ranks, [size] * ep.num_ranks, op), op)
    return True


def agreement_of(op: str, got: torch.Tensor, wait_ns: int) -> Agreement:
    """The headers ``got`` `[R, words]` int64 as the one round's :class:`Agreement` (a host read: error path only)."""
    words = got.tolist()
    return Agreement(
        [w[0] for w in words],
        [w[_HEAD : _HEAD + 2] for w in words],
        [tuple(w[_HEAD + 2 :]) for w in words],
        wait_ns // 1000,
        op,
    )
