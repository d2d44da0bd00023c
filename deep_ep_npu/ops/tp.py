"""The TP domain (tp_world_size 2): dispatch gathers the peer TP rank's received rows, combine reduce-scatters.

Seed 001 (MoeDistributeCombineV3): ``rsOut = ReduceScatterV(expand_x)``, ``ataOut = AllToAllV(rsOut)``. A TP pair
holds the same expert on both ranks (one routed expert per rank); each rank receives its own tokens over EP, then
both compute on the union (own rows first, then the peer's), and combine sums the two partial results of every
row on the rank that received it before returning it over EP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import MoeDistributeError, shape

_STATUS_OK = 0


TP_FINGERPRINT = ("hidden", "dtype / quant", "row_bytes", "num_moe_experts")


def tp_agree_status(
    tp_group: dist.ProcessGroup | None, status: int, fingerprint: tuple[int, ...] = (0,) * len(TP_FINGERPRINT)
) -> tuple[int, list[tuple[int, ...]]]:
    """Share a status and a parameter fingerprint across the TP pair (both ranks always call this).

    Returns the first non-OK status (else OK) and both ranks' fingerprints. A rank whose EP domain rejected its input
    still calls it, so its TP peer (in another EP domain) raises too instead of waiting in a later TP collective.
    """
    if tp_group is None:
        return status, []
    t = torch.tensor([status, *fingerprint], dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t, group=tp_group)
    bad = [int(v[0]) for v in out if int(v[0]) != _STATUS_OK]
    return (bad[0] if bad else _STATUS_OK), [tuple(v[1:].tolist()) for v in out]


def raise_if_peer_failed(
    tp_group: dist.ProcessGroup | None, status: int, op: str, fingerprint: tuple[int, ...]
) -> None:
    """After this rank's EP domain accepted the call: raise if the TP peer's did not, or if the pair disagrees."""
    agreed, prints = tp_agree_status(tp_group, status, fingerprint)
    if agreed != _STATUS_OK and status == _STATUS_OK:
        raise MoeDistributeError(agreed, "inputs", f"{op} aborted: the TP peer rank rejected its input")
    for i, name in enumerate(TP_FINGERPRINT):
        if prints and prints[0][i] != prints[1][i]:
            raise shape(name, f"{op}: the TP pair disagrees on {name} ({prints[0][i]} vs {prints[1][i]})")


def _swap(tp_group: dist.ProcessGroup, tp_rank: int, send: torch.Tensor, num_recv_rows: int) -> torch.Tensor:
    """Send `[n, B]` uint8 rows to the TP peer and receive its `[num_recv_rows, B]`."""
    row = send.shape[1]
    recv = torch.empty((num_recv_rows, row), dtype=torch.uint8)
    in_splits = [0, 0]
    out_splits = [0, 0]
    in_splits[1 - tp_rank] = send.shape[0] * row
    out_splits[1 - tp_rank] = num_recv_rows * row
    dist.all_to_all_single(recv.view(-1), send.reshape(-1), out_splits, in_splits, group=tp_group)
    return recv


def tp_allgather_rows(
    tp_group: dist.ProcessGroup, tp_rank: int, rows: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchange this rank's received rows with the TP peer.

    Arguments:
        rows: `[n, B]` `torch.uint8`, the encoded rows this rank received over EP.
        counts: `[m]` `torch.int64`, a fixed-size count vector (same m on both ranks).

    Returns:
        peer_rows: `[n_peer, B]` `torch.uint8`; peer_counts: `[m]` `torch.int64`.
    """
    meta = torch.cat([torch.tensor([rows.shape[0]], dtype=torch.int64), counts.to(torch.int64)])
    both = [torch.empty_like(meta) for _ in range(2)]
    dist.all_gather(both, meta, group=tp_group)
    peer = both[1 - tp_rank]
    return _swap(tp_group, tp_rank, rows, int(peer[0])), peer[1:]


def tp_reduce_scatter(
    tp_group: dist.ProcessGroup, tp_rank: int, expand_x: torch.Tensor, num_own: int, num_peer: int
) -> torch.Tensor:
    """ReduceScatterV over the TP pair: `[num_own, H]` = own partial + the peer's partial of my rows (fp32 add,
    one cast back to expand_x's dtype). ``expand_x`` rows: own ``[0, num_own)``, peer ``[num_own, num_own + num_peer)``.
    """
    hidden, dtype = expand_x.shape[1], expand_x.dtype
    send = (
        expand_x[num_own : num_own + num_peer].contiguous().view(torch.uint8).reshape(num_peer, hidden * dtype.itemsize)
    )
    recv = _swap(tp_group, tp_rank, send, num_own)
    peer_part = recv.view(dtype).view(num_own, hidden)
    return (expand_x[:num_own].float() + peer_part.float()).to(dtype)
