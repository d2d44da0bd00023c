"""DeepEP V2's ``tests/elastic/test_ep.py``, ported (written anew) to ``deep_ep_npu.ElasticBuffer``.

Per case, as DeepEP's: four dispatches (plain; expand with TMA-aligned scale factors; cached; cached expand with
weights and zero padding) and two combines (non-expand with its weights, expand), then its assertions, all bitwise
(``torch.equal``) against the single-process references of :mod:`tests.support.elastic_oracle`. The sweep is DeepEP's
(handle copy x alignment {128, 1} x fp8 x biases {0, 1, 2}, with previous_event / async cycled through the
cases), run inside one launch per configuration, with and without CPU sync, and without multiple reduction, on the
reference backend and on the ascend backend over the NPU stand-in.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.distributed import parallel_launch
from tests.support.elastic_oracle import (
    align,
    ordered_sum,
    pre_combine_data,
    rank_inputs,
    reference_combine,
    reference_dispatch,
)

N, H, K, SEED = 12, 256, 4, 3


def _sweep():
    cases = itertools.product((1, 0), (128, 1), (1, 0), (0, 1, 2))
    for i, (handle_copy, alignment, fp8, num_bias) in enumerate(cases):
        yield handle_copy, alignment, fp8, num_bias, i % 2, (i // 2) % 2


def _launch(buffer, name, previous_event, async_, **kwargs):
    if previous_event:
        kwargs.update(previous_event=buffer.capture(), allocate_on_comm_stream=True)
    values = getattr(buffer, name)(async_with_compute_stream=bool(async_), **kwargs)
    if async_:
        values[-1].current_stream_wait()
    return values


def _fold(expanded, indices, valid):
    """Every expand copy of a received token is identical: one row per token (DeepEP's fold_expanded)."""
    if isinstance(expanded, tuple):
        return tuple(_fold(t, indices, valid) for t in expanded)
    gathered = expanded[indices]  # [num_recv, K, ...]
    first = gathered[torch.arange(gathered.shape[0]), valid.int().argmax(dim=1)]
    same = (gathered == first.unsqueeze(1)).reshape(*valid.shape, -1).all(dim=-1) | ~valid
    assert bool(same.all()), "expand copies of a token differ"
    return first


def _case(buffer, info, inputs, num_experts, case, sync, backend):
    handle_copy, alignment, fp8, num_bias, prev, async_ = case
    r, rank = info.world_size, info.rank
    num_local = num_experts // r
    x, topk_idx, topk_weights = inputs[rank]
    g = torch.Generator().manual_seed(SEED * 7 + sum(case))
    bias = None
    if num_bias:
        biases = tuple(torch.randn((topk_idx.shape[0], H), generator=g).to(torch.bfloat16) for _ in range(num_bias))
        bias = biases[0] if num_bias == 1 else biases
    ref = reference_dispatch(inputs, rank, N, num_experts)

    common = dict(
        num_max_tokens_per_rank=N,
        num_experts=num_experts,
        expert_alignment=alignment,
        do_handle_copy=bool(handle_copy),
        do_cpu_sync=sync,
    )
    args = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, **common)
    recv_x, recv_idx, recv_w, handle, _ = _launch(buffer, "dispatch", prev, async_, **args)
    exp_args = args | dict(do_expand=True, use_tma_aligned_col_major_sf=True)
    exp_x, exp_idx, exp_w, exp_handle, _ = _launch(buffer, "dispatch", prev, async_, **exp_args)
    cached_x, cached_idx, _, cached_handle, _ = _launch(buffer, "dispatch", prev, async_, x=x, handle=handle)
    cached_exp_x, _, cached_exp_w, _, _ = _launch(
        buffer,
        "dispatch",
        prev,
        async_,
        x=x,
        topk_weights=topk_weights,
        do_expand=True,
        use_tma_aligned_col_major_sf=True,
        do_zero_padding=True,
        handle=exp_handle,
    )

    num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    assert num_recv == int(exp_handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == sum(ref["num_recv_per_rank"])
    assert torch.equal(handle.recv_src_metadata[:num_recv, 0].sort().values, ref["src"])
    if sync:
        assert recv_idx.shape[0] == num_recv and handle.num_recv_tokens == num_recv
    else:  # DeepEP's worst-case shapes
        worst = align(r * N * min(K, num_local) + (alignment - 1) * num_local, alignment)
        assert handle.num_recv_tokens == r * N == recv_idx.shape[0] and exp_handle.num_expanded_tokens == worst
        assert handle.num_recv_tokens_per_expert_list == [] and bool((recv_idx[num_recv:] == -1).all())

    # combine inputs: the pre-combine rows of each received token, zero where the slot is another rank's
    src = handle.recv_src_metadata[:num_recv, 0]
    local_y = pre_combine_data(src, r, N, K, H)
    local_y[recv_idx[:num_recv] == -1] = 0
    combine_x = torch.full((handle.num_recv_tokens, H), float("nan"), dtype=torch.bfloat16)  # tail: ignored
    combine_x[:num_recv] = ordered_sum(local_y)  # one pre-reduced row per (token, this rank)
    exp_src = exp_handle.recv_src_metadata[:num_recv, 0]
    exp_y = pre_combine_data(exp_src, r, N, K, H)
    slots = exp_handle.recv_src_metadata[:num_recv, 2:]
    exp_combine_x = torch.full((exp_handle.num_expanded_tokens, H), float("nan"), dtype=torch.bfloat16)  # padding
    exp_combine_x[slots[slots >= 0].long()] = exp_y[slots >= 0]
    weighted = backend == "reference"  # the Ascend combine carries no weights back (a clear error, tested below)
    combined, combined_w, _ = _launch(
        buffer,
        "combine",
        prev,
        async_,
        x=combine_x,
        bias=bias,
        handle=handle,
        topk_weights=recv_w if weighted else None,
    )
    multiple = buffer.allow_multiple_reduction
    exp_combined, exp_combined_w, _ = _launch(
        buffer,
        "combine",
        prev,
        async_,
        x=exp_combine_x,
        bias=bias,
        handle=exp_handle,
        topk_weights=exp_w if multiple and weighted else None,
    )

    # handle copy
    assert (topk_idx.data_ptr() != handle.topk_idx.data_ptr()) == bool(handle_copy)
    assert cached_handle is handle and cached_handle.topk_idx.data_ptr() == handle.topk_idx.data_ptr()
    recv_x_v = (recv_x[0][:num_recv], recv_x[1][:num_recv]) if fp8 else recv_x[:num_recv]
    cached_x_v = (cached_x[0][:num_recv], cached_x[1][:num_recv]) if fp8 else cached_x[:num_recv]
    recv_idx, recv_w = recv_idx[:num_recv], recv_w[:num_recv]
    meta, exp_meta = handle.recv_src_metadata[:num_recv], exp_handle.recv_src_metadata[:num_recv]

    # deterministic: a second dispatch gives the same rows
    again = _launch(buffer, "dispatch", prev, async_, **args)
    again_x = (again[0][0][:num_recv], again[0][1][:num_recv]) if fp8 else again[0][:num_recv]
    for a, b in zip(again_x if fp8 else (again_x,), recv_x_v if fp8 else (recv_x_v,), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(again[1][:num_recv], recv_idx) and torch.equal(again[3].recv_src_metadata[:num_recv], meta)

    # the statistics: unaligned counts
    stats = torch.zeros((num_local,), dtype=torch.int32)
    _launch(buffer, "dispatch", prev, async_, cumulative_local_expert_recv_stats=stats, **args)
    ref_counts = [int((ref["topk_idx"] == i).sum()) for i in range(num_local)]
    assert stats.tolist() == ref_counts

    # expand: no ids, one metadata row per received token; cached expand equals expand, padding zeroed
    assert exp_idx is None and exp_meta.shape[0] == num_recv and exp_handle.recv_src_metadata.shape[0] >= num_recv
    valid = exp_meta[:, 2:] >= 0
    safe = exp_meta[:, 2:].long().clamp(min=0)
    used = exp_meta[:, 2:][valid].long()
    for a, b in zip(exp_x if fp8 else (exp_x,), cached_exp_x if fp8 else (cached_exp_x,), strict=True):
        assert torch.equal(a[used], b[used])
    assert torch.equal(exp_w[used], cached_exp_w[used])
    if fp8:
        assert exp_x[1].stride(0) == 1  # TMA-aligned column-major scale factors
    psum_exp = [0, *exp_handle.psum_num_recv_tokens_per_expert.tolist()]
    for i in range(num_local):
        start, end = psum_exp[i + 1], align(psum_exp[i + 1], alignment)
        for t in cached_exp_x if fp8 else (cached_exp_x,):
            assert bool((t[start:end].float() == 0).all()), "zero padding"
        assert bool((cached_exp_w[start:end] == 0).all())
    folded_x = _fold(exp_x, safe, valid)
    folded_w = exp_w[safe]

    # cached equals uncached
    for a, b in zip(recv_x_v if fp8 else (recv_x_v,), cached_x_v if fp8 else (cached_x_v,), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(cached_idx[:num_recv], recv_idx)

    # counts: the aligned list, psum deltas (non-expand aligned, expand real), per source rank
    psum = [0, *handle.psum_num_recv_tokens_per_expert.tolist()]
    for i in range(num_local):
        if sync:
            assert handle.num_recv_tokens_per_expert_list[i] == align(ref_counts[i], alignment)
        assert psum[i + 1] - psum[i] == align(ref_counts[i], alignment)
        assert psum_exp[i + 1] - align(psum_exp[i], alignment) == ref_counts[i]
    per_rank = [0, *handle.psum_num_recv_tokens_per_scaleup_rank.tolist()]
    assert [per_rank[i + 1] - per_rank[i] for i in range(r)] == ref["num_recv_per_rank"]
    assert buffer.get_logical_domain_size() == (1, r)

    # the data, bitwise, after sorting by source index
    ref_mask = ref["topk_idx"] < 0
    for got_x, got_idx, got_w, got_meta in ((folded_x, None, folded_w, exp_meta), (recv_x_v, recv_idx, recv_w, meta)):
        order = got_meta[:, 0].sort()
        assert torch.equal(order.values, ref["src"])
        want = [(ref["topk_weights"].masked_fill(ref_mask, 0), got_w[order.indices].masked_fill(ref_mask, 0))]
        if got_idx is not None:
            want.append((ref["topk_idx"], got_idx[order.indices]))
        pairs = zip(ref["x"], got_x, strict=True) if fp8 else [(ref["x"], got_x)]
        want += [(a, b[order.indices]) for a, b in pairs]
        for a, b in want:
            assert a.dtype == b.dtype and torch.equal(
                a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b
            )

    # combine, bitwise
    y = pre_combine_data(rank * N + torch.arange(topk_idx.shape[0]), r, N, K, H)
    y[topk_idx == -1] = 0
    bias_last = backend == "ascend"
    want = reference_combine(y, topk_idx, num_local, bias, True, bias_last)
    want_exp = reference_combine(y, topk_idx, num_local, bias, multiple, bias_last)
    assert torch.equal(combined, want), f"combine: max diff {(combined.float() - want.float()).abs().max()}"
    assert torch.equal(exp_combined, want_exp), "expand combine"
    if not weighted:
        assert combined_w is None and exp_combined_w is None
        return
    assert torch.equal(combined_w, topk_weights)
    if multiple:
        assert torch.equal(exp_combined_w, topk_weights)
    else:
        assert exp_combined_w is None


def _unmappable(buffer, inputs, rank: int, num_experts: int) -> None:
    """What the Ascend ops cannot express raises, naming it (on every rank alike: nothing was sent)."""
    from deep_ep_npu import MoeDistributeError

    with pytest.raises(MoeDistributeError, match="no Ascend A2/A3 dispatch op") as err:
        buffer.dispatch(inputs[1][rank][0], inputs[1][rank][1], num_experts=num_experts)
    assert err.value.param == "x"
    x, topk_idx, topk_weights = inputs[0][rank]
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx, topk_weights, num_experts=num_experts)
    with pytest.raises(MoeDistributeError, match="carries per-slot values") as err:
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert err.value.param == "topk_weights"
    with pytest.raises(MoeDistributeError, match="one shared_expert_x") as err:
        buffer.combine(recv_x, handle, bias=(torch.zeros_like(x), torch.zeros_like(x)))
    assert err.value.param == "bias"


def _port(info, num_experts: int, sync: bool, multiple: bool, backend: str):
    if backend == "ascend":
        from deep_ep_npu import sim

        sim.install()
    from deep_ep_npu import ElasticBuffer

    buffer = ElasticBuffer(
        info.group,
        num_max_tokens_per_rank=N,
        hidden=H,
        allow_multiple_reduction=multiple,
        explicitly_destroy=True,
        backend=backend,
    )
    inputs = {
        fp8: [rank_inputs(j, N, H, K, num_experts, SEED, bool(fp8)) for j in range(info.world_size)] for fp8 in (0, 1)
    }
    checked = 0
    for case in _sweep():
        if backend == "ascend" and (case[2] or case[3] == 2):  # no Ascend op for these: clear errors, below
            continue
        _case(buffer, info, inputs[case[2]], num_experts, case, sync, backend)
        checked += 1
    if backend == "ascend":
        _unmappable(buffer, inputs, info.rank, num_experts)
    buffer.barrier()
    buffer.destroy()
    buffer.destroy()  # a second call is a no-op
    return checked


@pytest.mark.parametrize(
    "world_size, num_experts, sync, multiple",
    [(2, 8, True, True), (4, 16, True, True), (2, 8, False, True), (2, 8, True, False)],
    ids=["W2", "W4", "W2-no-cpu-sync", "W2-no-multiple-reduction"],
)
def test_elastic_port(world_size, num_experts, sync, multiple):
    results = parallel_launch(world_size, _port, num_experts, sync, multiple, "reference", timeout=180)
    assert results == [24] * world_size


@pytest.mark.parametrize(
    "world_size, num_experts, sync, multiple",
    [(2, 8, True, True), (4, 16, False, True), (2, 8, True, False)],
    ids=["W2", "W4-no-cpu-sync", "W2-no-multiple-reduction"],
)
def test_elastic_port_on_the_npu_stand_in(world_size, num_experts, sync, multiple):
    """The same sweep on the ascend backend over deep_ep_npu.sim (the MC2 ops' mapping), bf16 and one bias (fp8 and
    two biases have no op: they raise, checked too); bias added after the routed rows, as the op does."""
    results = parallel_launch(world_size, _port, num_experts, sync, multiple, "ascend", timeout=180)
    assert results == [8] * world_size


def _cached_past_early_bound(info):
    """A cached dispatch whose N x row bytes passes the early-payload bound (32 MiB on gloo) still checks and places:
    the handle's expected rows were once sent as "unknown" (-1) there and every cached dispatch raised."""
    from deep_ep_npu import ElasticBuffer

    buffer = ElasticBuffer(info.group, num_max_tokens_per_rank=16384, explicitly_destroy=True)
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn((4, 1024), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4)])
    recv_x, _, _, handle, _ = buffer.dispatch(x, idx, num_experts=8)
    again = buffer.dispatch(x * 2, handle=handle)[0]
    buffer.destroy()
    return torch.equal(again, (recv_x.float() * 2).to(torch.bfloat16))


def test_cached_dispatch_past_the_early_payload_bound():
    assert all(parallel_launch(2, _cached_past_early_bound, timeout=120))
