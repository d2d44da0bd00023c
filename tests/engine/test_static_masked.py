"""The masked layout's static round (:mod:`deep_ep_npu.engine.static_masked`): ``Buffer.low_latency_dispatch`` /
``low_latency_combine`` on the collective transport with the value checks off and the torch code (the CPU kernels
off, as a device runs it) give bit for bit what the engine's exchange (:mod:`deep_ep_npu.engine.masked`, checks on,
kernels on and off) gives: the received rows, scales, ``src_info``, ``layout_range``, ``recv_count``, the statistics
and the combined rows; in one collective per call and, after the first call of a shape, no host read. A mismatched
handle or a bad header raises on every rank; a lost peer raises ``EPRankFailure``."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer, envs, kernels
from deep_ep_npu.errors import MoeDistributeError
from deep_ep_npu.transports.group import EPGroup
from tests.support.deepep_utils import per_token_cast_back
from tests.support.distributed import parallel_launch, stop_victim, survivor_failure
from tests.support.host_reads import HostReads

H = 512
# (N, tokens per rank by rank, K, experts, dtype, quant, round_scale, use_ue8m0, slot_order, zero_copy)
CASES = [
    (8, [8, 5, 0, 3], 3, 8, torch.bfloat16, None, False, False, False, False),
    (6, [6, 6, 2, 1], 4, 16, torch.bfloat16, "fp8_e4m3", False, False, True, False),
    (4, [4, 1, 4, 2], 2, 8, torch.bfloat16, "fp8_e4m3", True, True, False, True),
    (5, [3, 5, 5, 0], 3, 12, torch.float32, None, False, False, True, False),
    (4, [4, 4, 3, 4], 5, 8, torch.bfloat16, "int8_per_token", False, False, False, False),  # K > L
    (3, [1, 3, 2, 3], 2, 8, torch.bfloat16, "fp8_e4m3", True, False, False, False),
]


def _policy(value: str) -> None:
    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = value
    envs.check_values.cache_clear()


def _inputs(rank: int, case: tuple, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, tokens, k, e, dtype = case[:5]
    t = tokens[rank % len(tokens)]
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn((t, H), generator=g).to(dtype)
    ids = torch.rand((t, e), generator=g).topk(k, dim=1).indices
    ids[torch.rand((t, k), generator=g) < 0.2] = -1
    return x, ids, torch.rand((t, k), generator=g)


def _call(buffer: Buffer, case: tuple, step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    n, _, k, e, _, quant, round_scale, ue8m0, slot_order, zero_copy = case
    x, ids, weights = _inputs(rank, case, step)
    nl = e // world
    stats, waits = torch.zeros((nl,), dtype=torch.int32), torch.zeros((world,), dtype=torch.int64)
    fp8 = dict(use_fp8=quant is not None, round_scale=round_scale, use_ue8m0=ue8m0, quant_format=quant)
    recv_x, count, handle, _, hook = buffer.low_latency_dispatch(
        x, ids, n, e, stats, waits, **fp8, return_recv_hook=True
    )
    hook()
    out = {"recv_count": count.clone(), "layout_range": handle.layout_range.clone(), "stats": stats}
    data, scales = (recv_x, None) if quant is None else recv_x
    valid = torch.arange(world * n).view(1, -1) < count.long().view(-1, 1)  # [L, R * N]
    out["rows"], out["src_info"] = data[valid].view(torch.uint8), handle.src_info[valid]
    if scales is not None:
        out["scales"] = scales[valid].clone()
        data = per_token_cast_back(data, scales)
    y = (data.float() * 2).to(data.dtype)
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    combined, _, _ = buffer.low_latency_combine(
        y, ids, weights, handle, zero_copy=zero_copy, slot_order=slot_order, combine_wait_recv_cost_stats=waits
    )
    out["combined"] = combined.clone()
    out["waited"] = (waits > 0).all().reshape(1)
    return out


def _run(info, static: bool, kernels_on: bool) -> list[tuple[list[str], list[str], list[dict[str, torch.Tensor]]]]:
    """Every case twice (the second: new values, host reads and collectives recorded)."""
    _policy("0" if static else "")
    buffer, issued = Buffer(info.group, transport="collective", explicitly_destroy=True), []
    real = EPGroup.start
    EPGroup.start = lambda group, launch, op: issued.append(op) or real(group, launch, op)  # type: ignore[method-assign]
    results = []
    try:
        with contextlib.nullcontext() if kernels_on else kernels.disabled():
            for case in CASES:
                first = _call(buffer, case, 0, info.rank, info.world_size)
                issued.clear()
                with HostReads() as reads:
                    second = _call(buffer, case, 1, info.rank, info.world_size)
                results.append((list(reads), list(issued), [first, second]))
    finally:
        EPGroup.start = real  # type: ignore[method-assign]
        buffer.destroy()
    return results


def test_static_round_is_bit_identical_to_the_exchange_in_one_round_without_host_reads():
    static = parallel_launch(4, _run, True, False, timeout=240)
    for kernels_on in (False, True):
        present = parallel_launch(4, _run, False, kernels_on, timeout=240)
        for rank, (got, want) in enumerate(zip(static, present, strict=True)):
            for i, ((reads, issued, outs), (_, _, wants)) in enumerate(zip(got, want, strict=True)):
                assert not reads, (rank, i, reads)
                assert issued == ["low_latency_dispatch", "low_latency_combine"], (rank, i, issued)
                for out, ref in zip(outs, wants, strict=True):
                    assert out.keys() == ref.keys()
                    for name, value in out.items():
                        assert torch.equal(value, ref[name]), (rank, i, name, kernels_on)
    assert all(outs[1]["rows"].numel() for _, _, outs in static[0]), "every case receives rows"


def _errors(info, what: str) -> str:
    """A mismatched handle (rank 1 passes another dispatch's) or a bad header (rank 1 another N) on the static
    round: the error each rank raises."""
    _policy("0")
    buffer = Buffer(info.group, transport="collective", explicitly_destroy=True)
    case = CASES[0]
    x, ids, weights = _inputs(info.rank, case, 0)
    with kernels.disabled():
        n = case[0] + (1 if what == "header" and info.rank == 1 else 0)
        try:
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, n, case[3], use_fp8=False)
            if what == "handle":
                other = torch.where(ids == ids.max(), -1, ids) if info.rank == 1 else ids  # (pairs dropped)
                buffer.low_latency_combine(recv_x, other, weights, handle)
        except MoeDistributeError as err:
            return str(err)
    return ""


@pytest.mark.parametrize("what", ["handle", "header"])
def test_static_round_raises_on_every_rank(what):
    errors = parallel_launch(4, _errors, what, timeout=120)
    assert all(errors), errors
    want = "handle" if what == "handle" else "num_max_dispatch_tokens_per_rank"
    assert all(want in e for e in errors) and len(set(errors)) == 1, errors


def _lost_peer(info, where: str) -> tuple | None:
    """Rank 1 stops before the static round's ``where`` (and exits); the others raise EPRankFailure naming it."""
    os.environ["DEEP_EP_NPU_TIMEOUT"] = "1.5"
    _policy("0")
    kernels.disabled().__enter__()  # (this rank process's whole life)
    store = dist.distributed_c10d._get_default_store()
    buffer, case = Buffer(info.group, transport="collective"), CASES[3]  # (12 experts: 3 ranks)
    x, ids, weights = _inputs(info.rank, case, 0)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, case[0], case[3], use_fp8=False)
    if info.rank == 1:
        if where == "combine":
            buffer.low_latency_dispatch(x, ids, case[0], case[3], use_fp8=False)
        stop_victim(store, "exit")

    def step() -> None:
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, case[0], case[3], use_fp8=False)
        buffer.low_latency_combine(recv_x, ids, weights, handle)

    return survivor_failure(store, info.rank, info.world_size - 1, step)


@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_static_round_names_a_lost_peer(where):
    results = parallel_launch(3, _lost_peer, where, timeout=60, allow_exit=(1,))
    for rank in (0, 2):
        assert results[rank] is not None and results[rank][0] == (1,) and results[rank][1] < 4.5, results[rank]


def _graph_step(info) -> tuple[list[str], bool, list[torch.Tensor]]:
    """The CUDA graph test's step (``tests/backends/test_device.py``: dispatch -> ``2 * rows`` -> combine) on the
    static round on CPU, as a capture runs it: after a warm-up, calls of the same result set write the same tensors
    (a graph replays into the captured ones) and read nothing back to the host."""
    from tests.backends.test_device import _inputs as step_inputs
    from tests.backends.test_device import _step

    _policy("0")
    buffer, got, seen = Buffer(info.group, transport="collective"), [], []
    with kernels.disabled():
        _step(buffer, *step_inputs(5 + info.rank))
        with HostReads() as reads:
            for seed in (6, 7, 8):
                recv_count, combined = _step(buffer, *step_inputs(seed + info.rank))
                seen.append((recv_count.data_ptr(), combined.data_ptr()))
                got.append(combined.clone())
    return list(reads), seen[0][0] == seen[2][0], got


def test_graph_step_on_cpu_reads_nothing_and_matches_the_oracle():
    from tests.backends.test_device import _check_oracle

    for rank, (reads, same_set, combined) in enumerate(parallel_launch(2, _graph_step, timeout=120)):
        assert not reads and same_set, (rank, reads)
        for seed, out in zip((6, 7, 8), combined, strict=True):
            _check_oracle({"combined": out}, seed + rank)


def _exact_reject(info) -> str:
    """The static round as on NCCL / HCCL (exact-size receives: the gloo bound set to 0): rank 1's second call has a
    bad ``topk_idx`` dtype; it sends its status at the peers' static size and every rank raises."""
    _policy("0")
    buffer, case = Buffer(info.group, transport="collective"), CASES[0]
    buffer._backend.collective.early_bytes = 0  # (what a group that is not gloo has)
    x, ids, _ = _inputs(info.rank, case, 0)
    with kernels.disabled():
        buffer.low_latency_dispatch(x, ids, case[0], case[3], use_fp8=False)
        bad = ids.float() if info.rank == 1 else ids
        try:
            buffer.low_latency_dispatch(x, bad, case[0], case[3], use_fp8=False)
        except MoeDistributeError as err:
            return str(err)
    return ""


def test_a_rejection_travels_at_the_static_size_on_exact_receives():
    errors = parallel_launch(4, _exact_reject, timeout=120)
    assert "topk_idx" in errors[1], errors
    assert all("rejected on rank 1" in e for i, e in enumerate(errors) if i != 1), errors
