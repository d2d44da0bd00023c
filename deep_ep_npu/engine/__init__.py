"""The engine (``docs/architecture.md``): :mod:`.exchange` (dispatch and combine, the ``reference`` backend), the
layouts :mod:`.masked` (DeepEP), :mod:`.flat` (Ascend, its TP stage :mod:`.tp`) and :mod:`.expand` (DeepEP V2),
:mod:`.plan`, :mod:`.rows`, :mod:`.reduce`, MegaMoE's :mod:`.pipeline` and :mod:`.ffn`; CPU loops in
:mod:`deep_ep_npu.kernels`. Here: :class:`Layout`, the contract between the exchange and a layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..transports.agreement import Agreement
    from .plan import Plan
    from .rows import Parts, RowFormat


class Layout(Protocol):
    """Where a dispatch's rows go (built by :mod:`.masked`, :mod:`.flat`, :mod:`.expand`'s ``layout(call, engine)``).
    ``source`` `[T, *]`: what the rows encode; ``weights`` `[P]` fp32 per pair, ``smooth`` `[num_rows, H]` fp32 per
    row, or None; ``known``: the rows each source sends here when already known (a cached layout); ``vectors``
    (<= 2R words) and ``fingerprint`` (<= 16, named by ``names``): the header words every rank checks (more checks:
    an optional ``check(agreement)``); ``agree_now``: the collective transport agrees in the send phase; ``tp``: the
    TP stage (:class:`~.flat.TPStage`). Optional ``place_own(own_rows, encode)``: places the own rows in the send phase
    (``encode()`` fills ``own_rows`` when they cannot come straight from the source); optional ``fields(d, out)``:
    writes the bytes of the rows ``out`` for rank d past the ones the encoder copied from ``source``."""

    plan: Plan
    fmt: RowFormat
    source: torch.Tensor
    weights: torch.Tensor | None
    smooth: torch.Tensor | None
    known: list[int] | None
    vectors: Sequence[int]
    fingerprint: Sequence[int]
    names: Sequence[str]
    agree_now: bool
    tp: Any

    def place(self, parts: Parts, own: tuple[int, torch.Tensor], agreement: Agreement, wait_ns: int) -> None: ...

    def result(self) -> Any: ...
