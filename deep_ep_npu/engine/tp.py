"""The TP domain (``tp_world_size`` 2): dispatch gathers the TP peer's received rows, combine reduce-scatters.

``rsOut = ReduceScatterV(expand_x)``, then ``AllToAllV(rsOut)`` over EP. A TP pair holds the same expert on both
ranks (one routed expert per rank); each rank receives its own tokens over EP, both compute on the union (own rows
first, then the peer's), and combine sums the two partial results of every row on the rank that received it before
returning it over EP. Every TP collective runs on the pair's :class:`~deep_ep_npu.group.EPGroup`: bounded, and a
peer that is gone is named in an :class:`~deep_ep_npu.failure.EPRankFailure`.
"""

from __future__ import annotations

import math

import torch

from ..errors import MoeDistributeError, shape
from ..group import STATUS_OK, EPGroup

NAMES = ("hidden", "dtype / quant", "row_bytes", "num_moe_experts")


def tp_agree(tp: EPGroup | None, status: int, op: str, fingerprint: tuple[int, ...] = (0,) * len(NAMES)) -> None:
    """Share this rank's status and fingerprint with its TP peer (both ranks always call it, also after their EP
    domain rejected the call, so the peer raises too instead of waiting); raise if the peer rejected or the pair
    disagrees."""
    if tp is None:
        return
    agreement = tp.start_agree(op, status, [[], []], fingerprint)()
    if status != STATUS_OK:
        return
    peer = [s for s in agreement.status if s != STATUS_OK]
    if peer:
        raise MoeDistributeError(peer[0], "inputs", f"{op} aborted: the TP peer rank rejected its input")
    for i, name in enumerate(NAMES):
        if agreement.shared[0][i] != agreement.shared[1][i]:
            a, b = agreement.shared[0][i], agreement.shared[1][i]
            raise shape(name, f"{op}: the TP pair disagrees on {name} ({a} vs {b})")


def _swap(tp: EPGroup, tp_rank: int, send: torch.Tensor, num_recv: int) -> torch.Tensor:
    """Send `[n, B]` uint8 rows to the TP peer and receive its `[num_recv, B]`."""
    recv = torch.empty((num_recv, send.shape[1]), dtype=torch.uint8, device=send.device)
    counts = [0, 0]
    recv_rows, send_rows = list(counts), list(counts)
    recv_rows[1 - tp_rank], send_rows[1 - tp_rank] = num_recv, send.shape[0]
    tp.transfer(recv, send, recv_rows, send_rows, "TP exchange").wait()
    return recv


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """`[n, ...]` rows as `[n, row_bytes]` uint8."""
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)


def tp_gather_rows(
    tp: EPGroup, tp_rank: int, expand_x: torch.Tensor, scales: torch.Tensor, num_own: int, counts: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Append the TP peer's received rows to ``expand_x`` / ``scales`` (rows ``[num_own, num_own + n_peer)``).

    Arguments:
        expand_x: `[2A, hidden]`; scales: `[2A]` or `[2A, ...]` fp32; counts: `[L * W]` int64 (same size on both).

    Returns:
        peer_counts `[L * W]` int64 and n_peer.
    """
    size = tp.start_agree("TP exchange", STATUS_OK, [[num_own, *counts.tolist()]] * 2, ())()
    peer = size.counts[1 - tp_rank]
    num_peer = peer[0]
    row_scales = scales.view(scales.shape[0], -1)
    send = torch.cat([_as_bytes(expand_x[:num_own]), _as_bytes(row_scales[:num_own])], dim=1)
    recv = _swap(tp, tp_rank, send, num_peer)
    data_bytes = expand_x.shape[1] * expand_x.dtype.itemsize
    at = slice(num_own, num_own + num_peer)
    expand_x[at] = recv[:, :data_bytes].contiguous().view(expand_x.dtype)
    row_scales[at] = recv[:, data_bytes:].contiguous().view(torch.float32)
    return torch.tensor(peer[1:], dtype=torch.int64, device=counts.device), num_peer


def tp_reduce_scatter(tp: EPGroup, tp_rank: int, expand_x: torch.Tensor, num_own: int, num_peer: int) -> torch.Tensor:
    """ReduceScatterV over the TP pair: `[num_own, H]` = own partial + the peer's partial of my rows (fp32 add, one
    cast back to expand_x's dtype). ``expand_x`` rows: own ``[0, num_own)``, peer ``[num_own, num_own + num_peer)``."""
    recv = _swap(tp, tp_rank, _as_bytes(expand_x[num_own : num_own + num_peer]), num_own)
    peer_part = recv.view(expand_x.dtype).view(num_own, expand_x.shape[1])
    return (expand_x[:num_own].float() + peer_part.float()).to(expand_x.dtype)
