"""The TP stage of the flat path (``tp_world_size`` 2): ``rsOut = ReduceScatterV(expand_x)``, then ``AllToAllV(rsOut)``
over EP. A TP pair holds the same expert on both ranks (one routed expert per rank): each receives its own tokens over
EP, both compute on the union (own rows first, then the peer's), and combine sums the two partial results of a row on
the rank that received it. Every TP collective runs on the pair's bounded ``EPGroup``."""

from __future__ import annotations

import torch

from ..errors import MoeDistributeError, shape
from ..transports.agreement import STATUS_OK
from ..transports.group import EPGroup

TP_NAMES = ("hidden", "dtype / quant", "row_bytes", "num_moe_experts")


def tp_agree(tp: EPGroup | None, status: int, op: str, fingerprint: tuple[int, ...] = (0,) * len(TP_NAMES)) -> None:
    """Share status and fingerprint with the TP peer (both ranks always call it, also after their EP domain rejected
    the call, so the peer raises too instead of waiting); raise if the peer rejected or the pair disagrees."""
    if tp is None:
        return
    agreement = tp.start_agree(op, status, [[], []], fingerprint)()
    if status != STATUS_OK:
        return
    if peer := [s for s in agreement.status if s != STATUS_OK]:
        raise MoeDistributeError(peer[0], "inputs", f"{op} aborted: the TP peer rank rejected its input")
    for name, a, b in zip(TP_NAMES, *agreement.shared[:2], strict=False):
        if a != b:
            raise shape(name, f"{op}: the TP pair disagrees on {name} ({a} vs {b})")


def _swap(tp: EPGroup, tp_rank: int, send: torch.Tensor, num_recv: int) -> torch.Tensor:
    """Send `[n, B]` uint8 rows to the TP peer and receive its `[num_recv, B]`."""
    recv = torch.empty((num_recv, send.shape[1]), dtype=torch.uint8, device=send.device)
    recv_rows, send_rows = ([0, n] if tp_rank == 0 else [n, 0] for n in (num_recv, send.shape[0]))
    if (pending := tp.transfer(recv, send, recv_rows, send_rows, "TP exchange")) is not None:
        tp.wait(pending, "TP exchange")
    return recv


def tp_gather_rows(
    tp: EPGroup, tp_rank: int, expand_x: torch.Tensor, scales: torch.Tensor, num_own: int, counts: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Append the TP peer's received rows after this rank's ``num_own`` rows of ``expand_x`` `[2A, H]` / ``scales``
    `[2A, ...]` fp32; returns ``counts`` `[L * W]` int64 followed by the peer's, and the peer's row count."""
    sizes = tp.start_agree("TP exchange", STATUS_OK, [[num_own, *counts.tolist()]] * 2, ())()
    num_peer, *peer_counts = sizes.counts[1 - tp_rank]
    row_scales, peer_rows = scales.view(scales.shape[0], -1), slice(num_own, num_own + num_peer)
    send = torch.cat([expand_x[:num_own].contiguous().view(torch.uint8), row_scales[:num_own].view(torch.uint8)], 1)
    recv = _swap(tp, tp_rank, send, num_peer)
    data_bytes = expand_x.shape[1] * expand_x.element_size()
    expand_x[peer_rows] = recv[:, :data_bytes].contiguous().view(expand_x.dtype)
    row_scales[peer_rows] = recv[:, data_bytes:].contiguous().view(torch.float32)
    return torch.cat([counts, counts.new_tensor(peer_counts)]), num_peer


def tp_reduce_scatter(tp: EPGroup, tp_rank: int, expand_x: torch.Tensor, num_own: int, num_peer: int) -> torch.Tensor:
    """ReduceScatterV: `[num_own, H]` = own partial + the peer's partial of my rows (fp32 add, one cast); rows of
    ``expand_x``: own ``[0, num_own)``, then the peer's ``[num_own, num_own + num_peer)``."""
    peer = _swap(tp, tp_rank, expand_x[num_own : num_own + num_peer].contiguous().view(torch.uint8), num_own)
    peer = peer.view(expand_x.dtype).view(num_own, expand_x.shape[1])
    return (expand_x[:num_own].float() + peer.float()).to(expand_x.dtype)
