"""The handles of DeepEP's normal mode (``Buffer.dispatch`` returns one, ``combine`` and a cached ``dispatch`` take it):
DeepEP's tuples, field for field, each also holding the layout it describes (``.layout``, an :class:`EPHandle`).

R ranks, T tokens of this rank, num_recv received rows, C = ``config.num_sms // 2`` channels (DeepEP's kernels split
a rank's tokens into C contiguous ranges, ``ceil(T / C)`` each). The exact fields: ``rank_prefix_matrix`` /
``recv_gbl_rank_prefix_sum`` (where each source rank's rows start: rows come grouped by source rank, tokens
ascending), ``is_token_in_rank``, the sender's channel prefix matrices, ``recv_src_idx``. The rest are what their
names say in this library's one-block-per-source layout (documented per field): engines pass them back unread."""

from __future__ import annotations

import torch

from .handle import EPHandle

SOURCE_META_BYTES = 8  # DeepEP's internode SourceMeta: (src host int32, bits of the host's ranks it goes to int32)


class IntranodeHandle(tuple):
    """DeepEP's intranode handle ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head)``:

    - rank_prefix_matrix: `[R, R]` `torch.int32`, ``[i][j]``: tokens ranks ``0..i`` send to rank j.
    - channel_prefix_matrix: `[R, C]` `torch.int32`, ``[j][c]``: this rank's tokens for rank j in channels ``0..c``.
    - recv_channel_prefix_matrix: `[R, C]` `torch.int32`, ``[i][c]``: where source i's rows start in ``recv_x``
      (one block per source here, the same for every channel).
    - recv_src_idx: `[num_recv]` `torch.int32`, each received row's token index on its source rank.
    - is_token_in_rank: `[T, R]` `torch.bool`.
    - send_head: `[T, R]` `torch.int32`, token t's row among the rows this rank sends rank j (-1: not sent).
    """

    layout: EPHandle

    def __new__(cls, fields: tuple = (), layout: EPHandle | None = None) -> IntranodeHandle:
        obj = super().__new__(cls, fields)
        obj.layout = layout  # type: ignore[assignment]
        return obj


class InternodeHandle(tuple):
    """DeepEP's internode handle ``(is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)``, H hosts of G ranks:

    - is_token_in_rank `[T, R]` `torch.bool`; rdma_channel_prefix_matrix `[H, C]` / gbl_channel_prefix_matrix
      `[R, C]` `torch.int32`: this rank's tokens for each host / rank in channels ``0..c``.
    - recv_rdma_channel_prefix_matrix `[H, C]`, recv_gbl_channel_prefix_matrix `[R, C]` `torch.int32`: where each
      source host's / rank's rows start in ``recv_x`` (the same for every channel).
    - recv_rdma_rank_prefix_sum `[H]`, recv_gbl_rank_prefix_sum `[R]` `torch.int32`: inclusive prefix sums of the rows
      received from each host / rank.
    - recv_src_meta: `[num_recv, 8]` `torch.uint8`: int32 source host, int32 bit set of this host's ranks it reached.
    - send_rdma_head `[T, H]` / send_nvl_head `[num_recv, G]` `torch.int32`: token t's row among this rank's rows for
      host h (-1: not sent) / received row i's row index on this rank's column of its host (-1 elsewhere).
    """

    layout: EPHandle

    def __new__(cls, fields: tuple = (), layout: EPHandle | None = None) -> InternodeHandle:
        obj = super().__new__(cls, fields)
        obj.layout = layout  # type: ignore[assignment]
        return obj


NormalHandle = IntranodeHandle | InternodeHandle


def channel_prefix(mask: torch.Tensor, num_channels: int) -> torch.Tensor:
    """`[D, C]` `torch.int32`: per destination (``mask`` `[T, D]` bool), the tokens in channels ``0..c``."""
    t = mask.shape[0]
    per = -(-t // max(num_channels, 1))
    ends = torch.clamp(torch.arange(1, num_channels + 1, device=mask.device) * per, max=t)
    csum = torch.cat([mask.new_zeros((1, mask.shape[1]), dtype=torch.int64), mask.long().cumsum(0)])
    return csum[ends].t().to(torch.int32).contiguous()


def send_head(mask: torch.Tensor) -> torch.Tensor:
    """`[T, D]` `torch.int32`: token t's position among the tokens sent to destination d, -1 where not sent."""
    return torch.where(mask, mask.int().cumsum(0) - 1, -1).to(torch.int32)


def starts(per_source: torch.Tensor, num_channels: int) -> torch.Tensor:
    """`[S, C]` `torch.int32`: the exclusive prefix of ``per_source`` `[S]`, repeated per channel."""
    begin = per_source.cumsum(0) - per_source
    return begin.to(torch.int32).unsqueeze(1).expand(-1, num_channels).contiguous()


def intranode(
    layout: EPHandle, is_token_in_rank: torch.Tensor, sent: torch.Tensor, rank: int, num_channels: int
) -> IntranodeHandle:
    """The handle of a fresh dispatch; ``sent`` `[R, R]` int64: tokens rank i sends rank j (the count round's).
    ``recv_src_idx`` is filled by :func:`complete` after the receive."""
    dev = is_token_in_rank.device
    recv_src_idx = torch.full((layout.num_recv_tokens,), -1, dtype=torch.int32, device=dev)
    fields = (
        sent.cumsum(0).to(torch.int32).to(dev),
        channel_prefix(is_token_in_rank, num_channels),
        starts(sent[:, rank], num_channels).to(dev),
        recv_src_idx,
        is_token_in_rank,
        send_head(is_token_in_rank),
    )
    return IntranodeHandle(fields, layout)


def internode(
    layout: EPHandle,
    is_token_in_rank: torch.Tensor,
    sent: torch.Tensor,
    rank: int,
    num_channels: int,
    nodes: list[list[int]],
) -> InternodeHandle:
    """:func:`intranode`'s internode form (``nodes``: each host's ranks, in rank order, G each)."""
    dev, rows, g = is_token_in_rank.device, layout.num_recv_tokens, len(nodes[0])
    to_node = torch.stack([is_token_in_rank[:, ranks].any(dim=1) for ranks in nodes], dim=1)
    from_rank = sent[:, rank].to(dev)
    from_node = torch.stack([from_rank[ranks].sum() for ranks in nodes])
    fields = (
        is_token_in_rank,
        channel_prefix(to_node, num_channels),
        channel_prefix(is_token_in_rank, num_channels),
        starts(from_node, num_channels),
        from_node.cumsum(0).to(torch.int32),
        starts(from_rank, num_channels),
        from_rank.cumsum(0).to(torch.int32),
        torch.zeros((rows, SOURCE_META_BYTES), dtype=torch.uint8, device=dev),
        send_head(to_node),
        torch.full((rows, g), -1, dtype=torch.int32, device=dev),
    )
    return InternodeHandle(fields, layout)


def complete(handle: NormalHandle, rank: int, ranks_per_node: int) -> None:
    """Fill the fields that need the received rows (from ``handle.layout``'s source metadata)."""
    h = handle.layout
    meta, n = h.recv_src_metadata, h.num_max_tokens_per_rank
    src, ok = meta[:, 1], meta[:, 1] >= 0
    token = torch.where(ok, meta[:, 0] - src * n, -1).to(torch.int32)
    if isinstance(handle, IntranodeHandle):
        handle[3].copy_(token)
        return
    words = handle[7].view(torch.int32)
    here = torch.full_like(src, 1 << (rank % ranks_per_node))
    words.copy_(torch.stack([torch.where(ok, src // ranks_per_node, -1), torch.where(ok, here, 0)], dim=1))
    column = handle[9][:, rank % ranks_per_node]
    column.copy_(torch.where(ok, torch.arange(src.numel(), device=src.device, dtype=torch.int32), -1))
