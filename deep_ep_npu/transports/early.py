"""The early payload of the collective transport: when a rank knows the rows each peer sends it (``counts[d][1] >= 0``,
a cached layout or a combine's handle), its payload starts in the send phase, before the agreement is checked.

Nothing is known to agree before the payload, so a peer's message may be longer than this rank expects (ranks that pass
the handles of different dispatches). On a gloo group, where a longer message than the receive posted aborts the
receiving process and a shorter one lands, every early receive is posted at :func:`early_bytes` from every live peer and
a rank sends its rows to each peer whole or, past that bound, none (announcing ``OVER_BOUND``, so that every rank
raises): only the announced rows are read, after the agreement is checked. On other groups the receive is posted at the
known size. A rank that did not know (a fresh call, or one that rejected its input) joins the started payloads
(:func:`.staged.join_started`), so that every rank reaches the check; when the check passes though ranks disagree on
starting early, every rank raises (:func:`check_started`)."""

from __future__ import annotations

import torch

from ..errors import ACLNN_ERR_INNER_TILING_ERROR
from .agreement import Agreement, EarlyMismatch

OVER_BOUND = ACLNN_ERR_INNER_TILING_ERROR  # the status of an early rank whose rows for a peer exceed the bound
PAYLOAD = "payload exchange"


def early_bytes(num_ranks: int, device: torch.device) -> int:
    """The most bytes of one rank's rows for another that an early payload carries on a gloo group of ``num_ranks``
    whose tensors live on ``device`` (each early receive is posted this long); 0 on other groups."""
    return min(32 << 20, (1 << 30) // num_ranks) if device.type == "cpu" else 0


def started(agreement: Agreement, live: list[int], rank: int) -> list[int]:
    """The ``live`` peers of ``rank`` that started their payload before the agreement (they knew what they receive)."""
    return [s for s in live if s != rank and agreement.counts[s][1:2] and agreement.counts[s][1] >= 0]


def check_started(agreement: Agreement, live: list[int], rank: int, early: bool) -> None:
    """Raise :class:`~.agreement.EarlyMismatch` (the same on every rank) when some ``live`` ranks started early and
    others did not (``early``: ``rank``, this one, did); the agreement itself was checked."""
    known = [*started(agreement, live, rank), *([rank] if early else [])]
    if known and len(known) < len(live):
        known, late = sorted(known), sorted(set(live) - set(known))
        why = f"{agreement.op}: ranks {known} knew the rows they receive and ranks {late} did not"
        raise EarlyMismatch(ACLNN_ERR_INNER_TILING_ERROR, why)
