"""The collective transport on gloo in one round (:mod:`deep_ep_npu.transports.one_round`): a dispatch and a combine
each issue one collective (counted at :meth:`EPGroup.start`, which every collective goes through), with the same
results as the shared-memory window; rows past the bound travel in a second round that every rank joins, same results.
"""

from __future__ import annotations

import torch

from deep_ep_npu import Buffer, ops
from deep_ep_npu.transports.group import EPGroup
from tests.support.distributed import parallel_launch

N, H, E, K = 8, 256, 8, 3


def _inputs(rank: int, num_tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((num_tokens, H), generator=g).to(torch.bfloat16)
    idx = torch.rand((num_tokens, E), generator=g).topk(K, dim=1).indices
    idx[1, 2] = -1
    return x, idx, torch.rand((num_tokens, K), generator=g)


class _Count:
    """Counts the collectives issued (their op names) while active."""

    def __enter__(self) -> list[str]:
        self.real, self.ops = EPGroup.start, []

        def start(group, launch, op):
            self.ops.append(op)
            return self.real(group, launch, op)

        EPGroup.start = start
        return self.ops

    def __exit__(self, *exc: object) -> None:
        EPGroup.start = self.real


def _round_trip(buffer: Buffer, rank: int, use_fp8: bool) -> tuple[list[str], list[str], torch.Tensor, torch.Tensor]:
    x, idx, w = _inputs(rank)
    with _Count() as dispatched:
        recv_x, count, handle, _, hook = buffer.low_latency_dispatch(
            x, idx, N, E, use_fp8=use_fp8, return_recv_hook=True
        )
        hook()
    data = recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2) if use_fp8 else recv_x.float()
    with _Count() as combined:
        out, _, _ = buffer.low_latency_combine((data * 2).to(torch.bfloat16), idx, w, handle)
    return dispatched, combined, count, out


def _flat_ops(info) -> tuple[list[str], list[str], torch.Tensor]:
    x, _, w = _inputs(info.rank)
    kw = dict(group_ep=info.group, ep_world_size=info.world_size, ep_rank_id=info.rank, moe_expert_num=E)
    ids = torch.rand((x.shape[0], E), generator=torch.Generator().manual_seed(info.rank)).topk(K).indices.int()
    with _Count() as dispatched:
        expand_x, _, assist, _, counts, tp_counts, _ = ops.moe_distribute_dispatch_v2(x, ids, **kw)
    with _Count() as combined:
        y = ops.moe_distribute_combine_v2(expand_x, ids, assist, counts, w, tp_send_counts=tp_counts, **kw)
    return dispatched, combined, y


def _counts(info) -> dict[str, object]:
    out: dict[str, object] = {}
    window = Buffer(info.group, backend="reference", transport="shm")
    collective = Buffer(info.group, backend="reference", transport="collective")
    for use_fp8 in (False, True):
        _round_trip(collective, info.rank, use_fp8)  # (a first call may set up)
        d, c, count, y = _round_trip(collective, info.rank, use_fp8)
        _, _, want_count, want_y = _round_trip(window, info.rank, use_fp8)
        assert torch.equal(count, want_count) and torch.equal(y, want_y)
        out[f"fp8={use_fp8}"] = (d, c)
    _flat_ops(info)
    d, c, _ = _flat_ops(info)
    out["flat ops"] = (d, c)
    # rows past the bound: headers first, then a second round of exact sizes, on every rank
    collective._backend.collective.early_bytes = 1024
    d, c, count, y = _round_trip(collective, info.rank, False)
    _, _, want_count, want_y = _round_trip(window, info.rank, False)
    assert torch.equal(count, want_count) and torch.equal(y, want_y)
    out["spilled"] = (d, c)
    return out


def test_dispatch_and_combine_take_one_collective_each():
    for rank, got in enumerate(parallel_launch(2, _counts, timeout=120)):
        for what in ("fp8=False", "fp8=True"):
            assert got[what] == (["low_latency_dispatch"], ["low_latency_combine"]), (rank, what, got[what])
        dispatched, combined = got["flat ops"]
        assert len(dispatched) == 1 and len(combined) == 1, (rank, got["flat ops"])
        assert got["spilled"] == (["low_latency_dispatch"] * 2, ["low_latency_combine"] * 2), (rank, got["spilled"])
