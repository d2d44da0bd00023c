"""The header words every call shares with its peers (:func:`header`) and the checks every rank runs on them
(:func:`check_status`, :func:`check_names`): the same error on every rank."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import MoeDistributeError, shape
from ..transports.agreement import STATUS_OK, Agreement
from ..transports.collective import EPGroup

FINGERPRINT = 16  # header words every layout may fill with what the ranks must agree on


def check_status(agreement: Agreement) -> None:
    """Raise the same error on every rank if any rank rejected its input."""
    if bad := [(r, s) for r, s in enumerate(agreement.status) if s != STATUS_OK]:
        ranks = ", ".join(f"rank {r} (aclnn {s})" for r, s in bad)
        raise MoeDistributeError(bad[0][1], "inputs", f"{agreement.op} aborted on every rank: rejected on {ranks}")


def check_names(agreement: Agreement, ep: EPGroup, names: Sequence[str], offset: int) -> None:
    """Raise the same error on every rank if the live ranks disagree on one of ``names`` (``shared[offset + i]``
    is ``names[i]``)."""
    for i, name in enumerate(names):
        values = [fp[offset + i] for fp in agreement.shared]
        if any(values[r] != values[ep.rank] for r in ep.live):
            msg = f"{agreement.op}: ranks disagree on {name} (per rank: {values}); it must be the same on all ranks"
            raise shape(name, msg)


def header(row_bytes: int, vectors: Sequence[int], fingerprint: Sequence[int], num_ranks: int) -> list[int]:
    """The shared header words of a call: the row size, up to 2R words of vectors, up to :data:`FINGERPRINT` words of
    fingerprint, each part zero-padded."""
    assert len(vectors) <= 2 * num_ranks and len(fingerprint) <= FINGERPRINT, "the layout's header words fit"
    pad = [0] * (2 * num_ranks - len(vectors)) + list(fingerprint) + [0] * (FINGERPRINT - len(fingerprint))
    return [row_bytes, *vectors, *pad]
