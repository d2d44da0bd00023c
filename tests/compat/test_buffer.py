"""DeepEP's low-latency test, ported (written anew) to ``deep_ep_npu.Buffer`` on the reference backend.

Per-rank markers ``rank - 128`` and per-token markers in the last 128 columns make every received row checkable:
counts against the gathered ``topk_idx``, rank blocks through ``layout_range``, token rows through ``src_info``.
Combine is checked against ``x * masked weight sum`` with ``calc_diff`` (DeepEP's thresholds), where the expected
per-token value is computed by an independent single-process fp8 oracle. Every rank builds every rank's inputs
from seeds, so the oracle needs no communication.
"""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import Buffer
from tests.support.deepep_utils import calc_diff, fp8_e4m3_reference, hash_tensor, per_token_cast_back
from tests.support.distributed import parallel_launch

RANK_OFFSET = 128
TRANSPORTS = ("shm", "collective")  # every multi-rank test runs on both, inside one launch


def make_inputs(rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int, seed: int, marker: bool):
    """Rank ``rank``'s (x, topk_idx, topk_weights): DeepEP's test pattern, reproducible on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if marker:
        x = torch.full((num_tokens, hidden), float(rank - RANK_OFFSET), dtype=torch.bfloat16)
        x[:, -128:] = torch.arange(num_tokens, dtype=torch.bfloat16).view(-1, 1)
    else:
        x = (torch.randn((num_tokens, hidden), generator=g) * 0.1).to(torch.bfloat16)
    scores = torch.randn((num_tokens, num_experts), generator=g).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1).indices
    if num_tokens:
        for _ in range(max(1, num_tokens // 4)):  # DeepEP sets 10 random entries to -1
            t = int(torch.randint(num_tokens, (1,), generator=g))
            k = int(torch.randint(num_topk, (1,), generator=g))
            topk_idx[t, k] = -1
    topk_weights = torch.randn((num_tokens, num_topk), generator=g).abs()
    return x, topk_idx, topk_weights


def expected_combine(x: torch.Tensor, topk_idx, topk_weights, fp8: str | None) -> torch.Tensor:
    if fp8 is not None:
        x = fp8_e4m3_reference(x, round_scale=fp8 == "round")
    return x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1, keepdim=True)


def _check_dispatch(info, recv_x, recv_count, handle, stats, all_idx, num_max, num_local, marker, round_scale):
    src_info, layout_range = handle[0], handle[1]
    assert handle.src_info is src_info and handle.layout_range is layout_range
    assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (num_local,)
    assert src_info.dtype == torch.int32 and layout_range.dtype == torch.int64
    r = info.world_size
    for i in range(num_local):
        expert_id = info.rank * num_local + i
        num_valid = int(recv_count[i])
        assert int(stats[i]) == num_valid
        assert num_valid == int((layout_range[i] & 0xFFFFFFFF).sum())
        assert num_valid == sum(int((idx == expert_id).sum()) for idx in all_idx)
        rows = recv_x[i, :num_valid].float()
        if not marker or not num_valid:
            continue
        assert torch.equal(rows[:, :-128].amin(dim=1), rows[:, :-128].amax(dim=1)), "a row is not one rank's marker"
        if round_scale:
            assert calc_diff(rows[:, -1], src_info[i, :num_valid].float()) < 0.007
        else:
            assert torch.equal(rows[:, -128:], src_info[i, :num_valid].float().view(-1, 1).expand(-1, 128))
            for j in range(r):
                begin, count = int(layout_range[i, j] >> 32), int(layout_range[i, j] & 0xFFFFFFFF)
                assert count == int((all_idx[j] == expert_id).sum())
                assert int((rows[:, 0] == j - RANK_OFFSET).sum()) == count
                assert torch.all(rows[begin : begin + count, 0] == j - RANK_OFFSET)
                # the token marker of each row is a token of rank j that chose this expert
                want = (all_idx[j] == expert_id).any(dim=1).nonzero().flatten().sort().values
                got = src_info[i, begin : begin + count].long().sort().values
                assert torch.equal(got, want)


def _ll_port(
    info, num_max: int, tokens_per_rank: list[int], hidden: int, num_topk: int, num_experts: int, seed: int, loop: bool
):
    if loop:  # fill recv_x with one gather per expert (the large-message path) instead of one scatter
        from deep_ep_npu.engine import masked as layouts

        layouts.LOOP_BYTES = 0
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_max, hidden, info.world_size, num_experts)
    return {
        t: _ll_rounds(info, num_max, tokens_per_rank, hidden, num_topk, num_experts, seed, num_rdma_bytes, t)
        for t in TRANSPORTS
    }


def _ll_rounds(info, num_max, tokens_per_rank, hidden, num_topk, num_experts, seed, num_rdma_bytes, transport):
    r, rank = info.world_size, info.rank
    num_local = num_experts // r
    buffer = Buffer(
        info.group,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=num_local,
        explicitly_destroy=True,
        backend="reference",
        transport=transport,
    )
    assert buffer._backend.transport.name == transport
    checked = 0
    for marker in (True, False):
        inputs = [make_inputs(j, tokens_per_rank[j], hidden, num_topk, num_experts, seed, marker) for j in range(r)]
        x, topk_idx, topk_weights = inputs[rank]
        all_idx = [inp[1] for inp in inputs]
        if rank % 2:
            topk_idx = topk_idx.to(torch.int32)  # both index widths are accepted
        for hook in (False, True):
            for fp8 in (None, "plain", "round", "ue8m0"):
                for zero_copy in (False, True):
                    round_scale, use_ue8m0 = fp8 in ("round", "ue8m0"), fp8 == "ue8m0"
                    hashes = []
                    for _ in range(1 + (checked % 2)):  # dispatch once or twice: buffers are reused
                        stats = torch.zeros((num_local,), dtype=torch.int32)
                        recv_x, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
                            x,
                            topk_idx,
                            num_max,
                            num_experts,
                            cumulative_local_expert_recv_stats=stats,
                            use_fp8=fp8 is not None,
                            round_scale=round_scale,
                            use_ue8m0=use_ue8m0,
                            async_finish=not hook,
                            return_recv_hook=hook,
                        )
                        if hook:
                            recv_hook()
                        else:
                            event.current_stream_wait()
                        if fp8 is not None:
                            data, scales = recv_x
                            assert data.dtype == torch.float8_e4m3fn
                            assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
                            assert scales.shape[:2] == data.shape[:2] and scales.stride(1) == 1
                            recv_x = per_token_cast_back(data, scales.contiguous())
                        assert tuple(recv_x.shape) == (num_local, r * num_max, hidden)
                        _check_dispatch(
                            info, recv_x, recv_count, handle, stats, all_idx, num_max, num_local, marker, round_scale
                        )
                        valid = torch.cat([recv_x[i, : int(recv_count[i])] for i in range(num_local)])
                        hashes.append(hash_tensor(valid))
                    assert len(set(hashes)) == 1, "a repeated dispatch produced different rows"

                    simulated_gemm_x = recv_x.clone()
                    combine_x = simulated_gemm_x
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
                        combine_x = torch.zeros_like(simulated_gemm_x)  # must be ignored
                    out = torch.full((x.shape[0], hidden), float("nan"), dtype=torch.bfloat16)
                    combined_x, event, recv_hook = buffer.low_latency_combine(
                        combine_x,
                        topk_idx,
                        topk_weights,
                        handle,
                        zero_copy=zero_copy,
                        async_finish=not hook,
                        return_recv_hook=hook,
                        out=out,
                    )
                    if hook:
                        recv_hook()
                    else:
                        with event:
                            pass
                    assert combined_x is out and not torch.isnan(combined_x).any()
                    want = expected_combine(x, all_idx[rank], topk_weights, None if fp8 is None else fp8)
                    if fp8 == "ue8m0":
                        want = expected_combine(x, all_idx[rank], topk_weights, "round")
                    assert tuple(combined_x.shape) == (x.shape[0], hidden)
                    if x.shape[0]:
                        diff = calc_diff(want, combined_x)
                        assert diff < (9e-4 if fp8 else 1e-5), f"combine diff {diff} (fp8={fp8}, hook={hook})"
                        # against the exact oracle the only error is the final bf16 rounding
                        assert torch.allclose(combined_x.float(), want, rtol=1e-2, atol=1e-2)
                    checked += 1
    buffer.destroy()
    buffer.destroy()  # idempotent
    return checked


@pytest.mark.parametrize(
    "world_size, tokens_per_rank, num_experts, loop",
    [(2, [16, 16], 6, True), (4, [16, 11, 16, 0], 12, False)],
    ids=["W2-gather-per-expert", "W4-uneven-and-empty-rank"],
)
def test_low_latency_port(world_size, tokens_per_rank, num_experts, loop):
    results = parallel_launch(world_size, _ll_port, 16, tokens_per_rank, 512, 4, num_experts, 7, loop, timeout=120)
    assert results == [{t: 32 for t in TRANSPORTS}] * world_size


def _two_batch_overlap(info, num_max: int, hidden: int, num_topk: int, num_experts: int):
    return [_two_batches(info, num_max, hidden, num_topk, num_experts, t) for t in TRANSPORTS]


def _two_batches(info, num_max: int, hidden: int, num_topk: int, num_experts: int, transport: str):
    """Two micro-batches in flight at once (DeepEP's two-batch overlap): both dispatches are sent before either
    is received, then both combines; the double-buffered communication buffers must keep them apart."""
    r, rank = info.world_size, info.rank
    buffer = Buffer(info.group, backend="reference", transport=transport)
    batches = [make_inputs(rank, num_max - b, hidden, num_topk, num_experts, 40 + b, marker=False) for b in (0, 1)]
    pending = [
        buffer.low_latency_dispatch(x, idx, num_max, num_experts, use_fp8=b == 1, return_recv_hook=True)
        for b, (x, idx, _) in enumerate(batches)
    ]
    for *_, hook in pending:
        hook()
    expert_out = [per_token_cast_back(*p[0]) if b == 1 else p[0] for b, p in enumerate(pending)]
    combines = [
        buffer.low_latency_combine(expert_out[b], idx, w, pending[b][2], return_recv_hook=True)
        for b, (_, idx, w) in enumerate(batches)
    ]
    for _, _, hook in reversed(combines):  # receive in the other order
        hook()
    for b, (x, idx, w) in enumerate(batches):
        want = expected_combine(x, idx, w, "plain" if b == 1 else None)
        assert calc_diff(want, combines[b][0]) < 1e-5

    # the stats tensors accumulate over calls; clean_low_latency_buffer is collective and leaves the buffer usable
    buffer.clean_low_latency_buffer(num_max, hidden, num_experts)
    x, idx, w = batches[0]
    recv_stats = torch.zeros((num_experts // r,), dtype=torch.int32)
    wait_stats = torch.zeros((r,), dtype=torch.int64)
    combine_wait = torch.zeros((r,), dtype=torch.int64)
    counts = []
    for _ in range(3):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, idx, num_max, num_experts, recv_stats, wait_stats, use_fp8=False
        )
        buffer.low_latency_combine(recv_x, idx, w, handle, combine_wait_recv_cost_stats=combine_wait)
        counts.append(recv_count.clone())
    assert torch.equal(recv_stats, counts[0] * 3) and int(recv_stats.sum()) > 0
    for waits in (wait_stats, combine_wait):  # receive waits (ns), the same wait added to every source's entry
        assert bool((waits > 0).all()) and waits.unique().numel() == 1
    return r


def test_two_micro_batches_in_flight():
    assert parallel_launch(2, _two_batch_overlap, 8, 256, 3, 8, timeout=60) == [[2, 2]] * 2
