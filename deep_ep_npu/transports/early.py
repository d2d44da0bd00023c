"""The early payload of the collective transport: when a rank knows the rows each peer sends it (``counts[d][1] >= 0``,
a cached layout or a combine's handle), its payload starts in the send phase, before the agreement is checked.

Nothing is known to agree before the payload, so a peer's message may be longer than this rank expects (ranks that
pass the handles of different dispatches). On a gloo group, where a longer message than the receive posted aborts the
receiving process and a shorter one lands, every early receive is posted at :func:`early_bytes` from every live peer
and a rank sends its rows to each peer whole or, past that bound, none (announcing ``OVER_BOUND``, so that every rank
raises): only the announced rows are read, after the agreement is checked. On other groups the receive is posted at
the known size. A rank that did not know (a fresh call, or one that rejected its input) joins the started payloads
(:func:`join_started`), so that every rank reaches the check; when the check passes though ranks disagree on starting
early, every rank raises (:func:`check_started`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ACLNN_ERR_INNER_TILING_ERROR, shape

if TYPE_CHECKING:
    from .collective import Agreement, EPGroup

OVER_BOUND = ACLNN_ERR_INNER_TILING_ERROR  # the status of an early rank whose rows for a peer exceed the bound
PAYLOAD = "payload exchange"


def early_bytes(ep: EPGroup) -> int:
    """The most bytes of one rank's rows for another that an early payload carries on a gloo group (each early receive
    is posted this long); 0 on other groups."""
    return min(32 << 20, (1 << 30) // ep.num_ranks) if ep.device.type == "cpu" else 0


def started(agreement: Agreement, ep: EPGroup) -> list[int]:
    """The live peers that started their payload before the agreement (they knew what they receive)."""
    return [s for s in ep.live if s != ep.rank and agreement.counts[s][1:2] and agreement.counts[s][1] >= 0]


def join_started(agreement: Agreement, ep: EPGroup, local: frozenset[int]) -> bool:
    """Join the payloads the peers started before the agreement, sending none on gloo (they posted the bound), else
    zeros of the posted size; whether any had started."""
    peers, bounded = started(agreement, ep), early_bytes(ep) > 0
    if not peers:
        return False
    recv, send = [0] * ep.num_ranks, [0] * ep.num_ranks
    for s in (s for s in peers if s not in local):  # (this host's peers' rows go another way)
        width = agreement.shared[s][0] if agreement.shared[s] else 0
        recv[s], send[s] = agreement.counts[s][0] * width, 0 if bounded else agreement.counts[s][1] * width
    landing = torch.empty((sum(recv),), dtype=torch.uint8, device=ep.device)
    zeros = torch.zeros((sum(send),), dtype=torch.uint8, device=ep.device)
    ep.wait(ep.all_to_all(landing, zeros, recv, send, PAYLOAD), PAYLOAD)
    return True


def check_started(agreement: Agreement, ep: EPGroup, early: bool) -> None:
    """Raise (the same error on every rank) when some live ranks started early and others did not (``early``: this
    rank did); the agreement itself was checked."""
    known = [*started(agreement, ep), *([ep.rank] if early else [])]
    if known and len(known) < len(ep.live):
        known, late = sorted(known), sorted(set(ep.live) - set(known))
        why = f"{agreement.op}: ranks {known} knew the rows they receive (a handle) and ranks {late} did not"
        raise shape("handle", f"{why}; every rank must pass the handle of the same dispatch, or none")
