"""Failure detection and input validation on the paths beside the masked Buffer API (public API only).

1. A peer that exits or hangs during a flat dispatch / combine (``Buffer.low_latency_*_flat``), a TP exchange
   (``ops.moe_distribute_dispatch_v2`` with ``group_tp``) or a MegaMoE call (``mega_moe`` / ``Buffer.mega_moe``)
   makes every survivor that shares a group with it raise :class:`EPRankFailure` naming it (in the numbering of
   the group whose collective failed), not excluded, within the timeout plus a few seconds.
2. Bad ids on the flat path get the same validation as the op: out-of-range int64 ids and negative ids other than
   -1 raise :class:`MoeDistributeError` naming the parameter on the bad rank, and a ``MoeDistributeError`` on
   every peer (no hang).

Every launch is bounded (``timeout=``), so a path that does not detect the failure fails the test instead of hanging.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer, EPRankFailure, MoeDistributeError
from deep_ep_npu import ops as ep_ops
from deep_ep_npu.mega_moe import mega_moe
from tests.support.distributed import leave_together, parallel_launch, stop_victim

TIMEOUT = 1.5  # the failure-detection bound under test
SLACK = 4.0  # allowed on top of it (agreement, process scheduling)
LAUNCH_TIMEOUT = 20  # per launch: a path that never detects the failure fails here instead of hanging CI
N, H, K = 4, 64, 2  # tokens per rank (= num_max_dispatch_tokens_per_rank), hidden, topk
FFN = 32  # MegaMoE intermediate size


def _inputs(rank: int, num_experts: int, tokens: int = N, topk: int = K):
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn((tokens, H), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(tokens)]).long()
    return x, ids, torch.softmax(torch.randn((tokens, topk), generator=g), dim=-1)


# ---------------------------------------------------------------- the rounds (stop_before: where the victim stops)


def _setup(kind: str, info):
    """Collective setup every rank (victim included) does before the warm-up round."""
    if kind in ("flat", "buffer_mega_moe"):
        return Buffer(info.group, explicitly_destroy=True, timeout=TIMEOUT, backend="reference")
    if kind == "tp":  # EP groups {0,1}, {2,3}; TP pairs {0,2}, {1,3} (as tests/ops/test_ops_tp.py)
        ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return ep[info.rank // 2], tp[info.rank % 2]
    return None


def _flat_round(buf, info, stop_before: str | None = None):
    e = 2 * info.world_size
    x, ids, w = _inputs(info.rank, e)
    if stop_before == "dispatch":
        return None
    out, _, _ = buf.low_latency_dispatch_flat(x, ids, N, e, topk_weights=w)
    if stop_before == "combine":
        return None
    combined, _, _ = buf.low_latency_combine_flat(out.expand_x, ids, w, out.handle)
    return combined


def _tp_round(groups, info, stop_before: str | None = None):
    """EP 2 x TP 2; the victim stops by not calling at all, so its EP peer misses it in the EP part and its TP
    peer (whose own EP group completes) misses it in the TP exchange."""
    if stop_before is not None:
        return None
    ep, tp = groups
    x, ids, w = _inputs(info.rank, 2, topk=1)
    return ep_ops.moe_distribute_dispatch_v2(
        x, ids, ep, 2, info.rank % 2, 2, expert_scales=w, group_tp=tp, tp_world_size=2, tp_rank_id=info.rank // 2
    )


def _mega_moe_round(buf, info, stop_before: str | None = None):
    if stop_before is not None:
        return None
    w_ = info.world_size
    x, ids, p = _inputs(info.rank, w_, topk=1)  # one local expert per rank
    g = torch.Generator().manual_seed(99)
    w1 = (torch.randn((w_, H, 2 * FFN), generator=g) / H**0.5).to(torch.bfloat16)[info.rank : info.rank + 1]
    w2 = (torch.randn((w_, FFN, H), generator=g) / FFN**0.5).to(torch.bfloat16)[info.rank : info.rank + 1]
    kw = dict(num_max_dispatch_tokens_per_rank=N, num_experts=w_)
    if buf is not None:
        return buf.mega_moe(x, ids, p, w1, w2, **kw)
    return mega_moe(info.group, x, ids, p, w1, w2, **kw)


_ROUNDS = {"flat": _flat_round, "tp": _tp_round, "mega_moe": _mega_moe_round, "buffer_mega_moe": _mega_moe_round}


def _failure(info, kind: str, where: str | None, how: str, victim: int):
    if kind in ("tp", "mega_moe"):
        os.environ["DEEP_EP_NPU_TIMEOUT"] = str(TIMEOUT)  # read when the group's EPGroup is created
    else:
        os.environ.pop("DEEP_EP_NPU_TIMEOUT", None)  # the Buffer's timeout= must be the one that counts
    store = dist.distributed_c10d._get_default_store()
    ctx = _setup(kind, info)
    round_fn = _ROUNDS[kind]
    round_fn(ctx, info)  # warm-up: every rank completes one call
    if info.rank == victim:
        round_fn(ctx, info, stop_before=where or "dispatch")
        stop_victim(store, how)
    t0 = time.monotonic()
    try:
        round_fn(ctx, info)
        out = ("ok",)
    except EPRankFailure as err:
        out = ("EPRankFailure", err.missing_ranks, err.excluded, time.monotonic() - t0, str(err))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on it
        out = (type(err).__name__, str(err), time.monotonic() - t0)
    if isinstance(ctx, Buffer):
        ctx.destroy()
    leave_together(store, info.rank, info.world_size - 1)
    return out


def _assert_named(results, survivors: dict[int, int]) -> None:
    """``survivors``: global rank -> the victim's rank in the group whose collective that survivor shares with it."""
    for rank, victim_rank in survivors.items():
        res = results[rank]
        assert res[0] == "EPRankFailure", f"rank {rank}: {res}"
        _, missing, excluded, elapsed, message = res
        assert missing == (victim_rank,), f"rank {rank}: {res}"
        assert not excluded, f"rank {rank}: {res}"
        assert elapsed < TIMEOUT + SLACK, f"rank {rank}: detected after {elapsed:.1f}s"
        assert f"ranks [{victim_rank}]" in message, f"rank {rank}: {message}"


# ---------------------------------------------------------------- 1. failures


@pytest.mark.parametrize(
    ("world_size", "where", "how", "victim"), [(2, "dispatch", "exit", 1), (4, "combine", "hang", 2)]
)
def test_flat_peer_failure_names_the_victim(world_size, where, how, victim):
    results = parallel_launch(
        world_size, _failure, "flat", where, how, victim, timeout=LAUNCH_TIMEOUT, allow_exit=(victim,)
    )
    _assert_named(results, {r: victim for r in range(world_size) if r != victim})


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_tp_peer_failure_names_the_victim(how):
    # victim 3 is rank 1 of EP group {2, 3} and rank 1 of TP pair {1, 3}: its EP peer 2 and TP peer 1 must name
    # rank 1 (the victim in either numbering; rank 0 would be a live rank in both). Rank 0 shares no group with
    # the victim: not asserted.
    results = parallel_launch(4, _failure, "tp", None, how, 3, timeout=LAUNCH_TIMEOUT, allow_exit=(3,))
    _assert_named(results, {2: 1, 1: 1})


@pytest.mark.parametrize(("kind", "how"), [("mega_moe", "exit"), ("buffer_mega_moe", "hang")])
def test_mega_moe_peer_failure_names_the_victim(kind, how):
    results = parallel_launch(2, _failure, kind, None, how, 1, timeout=LAUNCH_TIMEOUT, allow_exit=(1,))
    _assert_named(results, {0: 1})


# ---------------------------------------------------------------- 2. validation of bad ids


def _bad_ids(info, path: str, bad: int, bad_rank: int):
    os.environ["DEEP_EP_NPU_TIMEOUT"] = str(TIMEOUT)  # a peer left waiting fails fast instead of hanging
    e = 2 * info.world_size
    x, ids, w = _inputs(info.rank, e)
    if info.rank == bad_rank:
        ids[1, 0] = bad
    buf = Buffer(info.group, explicitly_destroy=True, timeout=TIMEOUT, backend="reference") if path == "flat" else None
    try:
        if buf is not None:
            buf.low_latency_dispatch_flat(x, ids, N, e, topk_weights=w)
        else:
            ep_ops.moe_distribute_dispatch_v2(x, ids, info.group, info.world_size, info.rank, e)
        out = ("ok",)
    except MoeDistributeError as err:
        out = ("MoeDistributeError", err.param, str(err))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which asserts on it
        out = (type(err).__name__, str(err))
    if buf is not None:
        buf.destroy()
    return out


def _assert_rejected(results, param: str, bad_rank: int) -> None:
    for rank, res in enumerate(results):
        assert res[0] == "MoeDistributeError", f"rank {rank}: {res}"
        if rank == bad_rank:
            assert res[1] == param, f"rank {rank}: {res}"
        else:
            assert f"rank {bad_rank}" in res[2], f"rank {rank}: the peer's error must name the bad rank: {res}"


@pytest.mark.parametrize("bad", [2**32 + 3, -7], ids=["2**32+3", "-7"])
def test_flat_dispatch_rejects_bad_int64_ids_on_every_rank(bad):
    results = parallel_launch(2, _bad_ids, "flat", bad, 1, timeout=LAUNCH_TIMEOUT)
    _assert_rejected(results, "topk_idx", 1)


@pytest.mark.parametrize("bad", [2**32 + 3, -7, -1], ids=["2**32+3", "-7", "-1"])
def test_op_dispatch_rejects_bad_int64_ids_on_every_rank(bad):
    results = parallel_launch(2, _bad_ids, "op", bad, 1, timeout=LAUNCH_TIMEOUT)
    _assert_rejected(results, "expert_ids", 1)
