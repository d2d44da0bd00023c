"""The Buffer beyond DeepEP's core: the flat Ascend layout with its native extras, and shrink-mode masking.

Oracles are single-process: every rank rebuilds every rank's inputs from seeds and computes the expected rows.
"""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import Buffer, FlatHandle, MoeDistributeError
from tests.support.deepep_utils import calc_diff, fp8_e4m3_reference, per_token_cast_back
from tests.support.distributed import parallel_launch

N, H, E, K = 6, 128, 8, 3


def _inputs(rank: int, num_tokens: int):
    g = torch.Generator().manual_seed(500 + rank)
    x = (torch.randn((num_tokens, H), generator=g) * 0.5).to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand((num_tokens, E), generator=g), K, dim=1).indices
    if num_tokens > 2:
        topk_idx[2, 1] = -1
    weights = torch.rand((num_tokens, K), generator=g)
    return x, topk_idx, weights


def _int8_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=1, keepdim=True)
    q = torch.round(x.float() * 127.0 / amax).to(torch.int8)
    return q, (amax / 127.0).flatten()


def _flat(info):
    r, rank, num_local = info.world_size, info.rank, E // info.world_size
    tokens = [N, 4, 0, N][:r]
    inputs = [_inputs(j, tokens[j]) for j in range(r)]
    active = [tokens[j] - (1 if j == 1 else 0) for j in range(r)]  # rank 1 masks its last token
    x, topk_idx, weights = inputs[rank]
    mask = torch.arange(tokens[rank]) < active[rank]
    buffer = Buffer(info.group, backend="reference")
    # expected rows, expert-major, then source rank, then token
    want_x, want_w, counts = [], [], []
    for i in range(num_local):
        e = rank * num_local + i
        n_i = 0
        for j in range(r):
            xj, idx_j, w_j = inputs[j]
            hit = (idx_j[: active[j]] == e).nonzero()
            want_x.append(xj[hit[:, 0]])
            want_w.append(w_j[hit[:, 0], hit[:, 1]])
            n_i += hit.shape[0]
        counts.append(n_i)
    want_x, want_w = torch.cat(want_x), torch.cat(want_w)
    total = want_x.shape[0]
    shared_x = torch.full((tokens[rank], H), 0.25, dtype=torch.bfloat16)
    for quant_mode, hook in ((0, False), (2, True)):
        result, event, recv_hook = buffer.low_latency_dispatch_flat(
            x,
            topk_idx,
            N,
            E,
            topk_weights=weights,
            quant_mode=quant_mode,
            x_active_mask=mask,
            expert_token_nums_type=0,
            return_recv_hook=hook,
        )
        if hook:
            with pytest.raises(RuntimeError, match="not received yet"):
                result.expand_x  # noqa: B018
            recv_hook()
        assert isinstance(result.handle, FlatHandle)
        assert result.expert_token_nums.tolist() == torch.tensor(counts).cumsum(0).tolist()
        assert torch.equal(result.handle.expand_scales[:total], want_w)
        expand_x = result.expand_x
        if quant_mode == 2:
            q, s = _int8_oracle(want_x)
            assert torch.equal(expand_x[:total], q) and torch.allclose(result.dynamic_scales[:total], s)
            expert_out = (expand_x.float() * result.dynamic_scales.unsqueeze(1)).to(torch.bfloat16)
        else:
            assert torch.equal(expand_x[:total], want_x)
            expert_out = expand_x
        expert_out = (expert_out.float() * 2).to(torch.bfloat16)
        combined, event, recv_hook = buffer.low_latency_combine_flat(
            expert_out, topk_idx, weights, result.handle, shared_expert_x=shared_x, async_finish=hook
        )
        event.current_stream_wait()
        want = 2 * x.float() * weights.masked_fill(topk_idx < 0, 0).sum(dim=1, keepdim=True) + 0.25
        want[active[rank] :] = 0
        if tokens[rank]:
            assert calc_diff(combined, want) < (1e-4 if quant_mode else 1e-5)
    # bad input on one rank: the op rejects it on every rank
    bad_idx = topk_idx.float() if rank == 1 else topk_idx
    with pytest.raises(MoeDistributeError, match="topk_idx" if rank == 1 else "rejected on rank 1"):
        buffer.low_latency_dispatch_flat(x, bad_idx, N, E)
    return True


def test_flat_layout_extras():
    assert parallel_launch(4, _flat, timeout=60) == [True] * 4


def _shrink(info):
    r, rank, num_local = info.world_size, info.rank, E // info.world_size
    buffer = Buffer(info.group, enable_shrink=True, backend="reference")
    inputs = [_inputs(j, N) for j in range(r)]
    x, topk_idx, weights = inputs[rank]
    status = torch.zeros((r,), dtype=torch.int32)
    for masked in (1, None):
        if masked is not None:
            buffer.low_latency_update_mask_buffer(masked, True)
        else:
            buffer.low_latency_clean_mask_buffer()
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(j == masked) for j in range(r)]

        def alive(j: int, e: torch.Tensor, masked: int | None = masked) -> torch.Tensor:
            return (e >= 0) & (j != masked) & (e // num_local != masked)

        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        for i in range(num_local):
            e = rank * num_local + i
            want = sum(int(((idx == e) & alive(j, idx)).sum()) for j, (_, idx, _) in enumerate(inputs))
            assert int(recv_count[i]) == want
        combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, weights, handle)
        ref = x.float() * weights.masked_fill(~alive(rank, topk_idx), 0).sum(dim=1, keepdim=True)
        assert calc_diff(combined, ref) < 1e-5
        if masked == rank:
            assert not combined.any()
    return True


def test_shrink_mask_treats_masked_ranks_as_absent():
    assert parallel_launch(4, _shrink, timeout=60) == [True] * 4


def _dtypes_and_odd_hidden(info):
    buffer = Buffer(info.group, backend="reference")
    checked = []
    for dtype, hidden in ((torch.float32, 64), (torch.float16, 96), (torch.bfloat16, 101), (torch.bfloat16, 3)):
        g = torch.Generator().manual_seed(info.rank)
        x = torch.randn((5, hidden), generator=g).to(dtype)
        topk_idx = torch.topk(torch.rand((5, E), generator=g), K, dim=1).indices
        weights = torch.rand((5, K), generator=g)
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        assert recv_x.dtype == dtype and tuple(recv_x.shape) == (E // info.world_size, info.world_size * N, hidden)
        combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, weights, handle)
        want = x.float() * weights.sum(dim=1, keepdim=True)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert combined.dtype == dtype and torch.allclose(combined.float(), want, rtol=tol, atol=tol)
        checked.append(int(recv_count.sum()))
    return checked


def test_other_dtypes_and_odd_hidden():
    """float32 / float16 activations and hidden sizes that are not multiples of 8 (bf16 only in DeepEP)."""
    results = parallel_launch(2, _dtypes_and_odd_hidden, timeout=60)
    assert sum(sum(r) for r in results) == 2 * 4 * 5 * K  # every (token, k) of both ranks arrives once


def _special_experts(info):
    """Zero and copy experts through the flat path: a copy expert adds ``w * x`` at the source, a zero expert 0."""
    num_zero, num_copy, num_experts = 1, 1, 4
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn((5, 64), generator=g).to(torch.bfloat16)
    topk_idx = torch.tensor([[0, 4, 5], [1, -1, 2], [5, 3, -1], [4, 0, 1], [-1, -1, -1]])
    weights = torch.rand((5, 3), generator=g)
    buffer = Buffer(info.group, backend="reference")
    result, _, _ = buffer.low_latency_dispatch_flat(
        x, topk_idx, 8, num_experts, zero_expert_num=num_zero, copy_expert_num=num_copy
    )
    expert_out = (result.expand_x.float() * 2).to(torch.bfloat16)
    combined, _, _ = buffer.low_latency_combine_flat(expert_out, topk_idx, weights, result.handle, ori_x=x)
    routed = (topk_idx >= 0) & (topk_idx < num_experts)
    copied = topk_idx == num_experts + num_zero
    factor = (2 * weights * routed + weights * copied).sum(dim=1, keepdim=True)
    assert calc_diff(combined, x.float() * factor) < 1e-5
    return int(result.expert_token_nums.sum())


def test_flat_zero_and_copy_experts():
    counts = parallel_launch(2, _special_experts, timeout=60)
    assert sum(counts) == 2 * 6  # routed (token, k) pairs of both ranks: 6 per rank


def _shared_expert_rank(info):
    """One shared-expert rank (rank 0) and two MoE ranks: every token also visits the shared expert, whose output
    is added with weight 1."""
    num_experts = 4  # on ranks 1 and 2
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn((4, 64), generator=g).to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand((4, num_experts), generator=g), 2, dim=1).indices
    topk_idx[0, 1] = -1
    weights = torch.rand((4, 2), generator=g)
    buffer = Buffer(info.group, backend="reference")
    result, _, _ = buffer.low_latency_dispatch_flat(
        x, topk_idx, 4, num_experts, shared_expert_num=1, shared_expert_rank_num=1
    )
    expert_out = (result.expand_x.float() * 2).to(torch.bfloat16)
    combined, _, _ = buffer.low_latency_combine_flat(expert_out, topk_idx, weights, result.handle)
    factor = 2 * weights.masked_fill(topk_idx < 0, 0).sum(dim=1, keepdim=True) + 2
    assert calc_diff(combined, x.float() * factor) < 1e-5
    return int(result.expert_token_nums.sum())


def test_flat_shared_expert_rank():
    counts = parallel_launch(3, _shared_expert_rank, timeout=60)
    assert counts[0] == 3 * 4  # the shared-expert rank sees every token of every rank


def _nothing_received(info):
    """Every token of every rank goes to rank 0's experts: rank 1 receives no row at all (and returns none)."""
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn((6, 256), generator=g).to(torch.bfloat16)
    topk_idx = torch.tensor([[0, 1], [1, -1], [0, 1], [1, 0], [-1, -1], [0, -1]])
    weights = torch.rand((6, 2), generator=g)
    buffer = Buffer(info.group, backend="reference")
    counts = []
    for use_fp8 in (False, True):
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, 8, 4, use_fp8=use_fp8, return_recv_hook=True
        )
        hook()
        expert_out = per_token_cast_back(*recv_x) if use_fp8 else recv_x
        combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
        want = fp8_e4m3_reference(x, False) if use_fp8 else x
        assert calc_diff(combined, want.float() * weights.masked_fill(topk_idx < 0, 0).sum(1, keepdim=True)) < 1e-5
        counts.append(recv_count.tolist())
    return counts


def test_a_rank_that_receives_nothing():
    counts = parallel_launch(2, _nothing_received, timeout=60)
    assert counts[1] == [[0, 0], [0, 0]] and counts[0] == [[8, 8], [8, 8]]
