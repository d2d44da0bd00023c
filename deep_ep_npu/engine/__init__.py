"""The engine (``docs/architecture.md``): :mod:`.exchange` (dispatch and combine, the ``reference`` backend), the
layouts :mod:`.masked` (DeepEP), :mod:`.flat` (Ascend, its TP stage :mod:`.tp`) and :mod:`.expand` (DeepEP V2),
:mod:`.plan`, :mod:`.rows`, :mod:`.reduce`, MegaMoE's :mod:`.pipeline` and :mod:`.ffn`; CPU loops in
:mod:`deep_ep_npu.kernels`. Here: :class:`Layout`, the contract between the exchange and a layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..transports.agreement import Agreement
    from .flat import TPStage
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

    @property
    def plan(self) -> Plan: ...
    @property
    def fmt(self) -> RowFormat: ...
    @property
    def source(self) -> torch.Tensor: ...
    @property
    def weights(self) -> torch.Tensor | None: ...
    @property
    def smooth(self) -> torch.Tensor | None: ...
    @property
    def known(self) -> list[int] | None: ...
    @property
    def vectors(self) -> Sequence[int]: ...
    @property
    def fingerprint(self) -> Sequence[int]: ...
    @property
    def names(self) -> Sequence[str]: ...
    @property
    def agree_now(self) -> bool: ...
    @property
    def tp(self) -> TPStage | None: ...

    def place(self, parts: Parts, own: tuple[int, torch.Tensor], agreement: Agreement, wait_ns: int) -> None: ...

    def result(self) -> object: ...
