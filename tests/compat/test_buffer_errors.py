"""Bad input to ``Buffer`` raises a clear error on every rank (never a hang), and the group stays usable after it."""

from __future__ import annotations

import os

import pytest
import torch

from deep_ep_npu import Buffer, MoeDistributeError, envs
from tests.support.distributed import parallel_launch

N, H, E, K = 8, 256, 8, 2


def _inputs(rank: int, num_tokens: int = 4):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((num_tokens, H), generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)])
    weights = torch.rand((num_tokens, K), generator=g)
    return x, topk_idx, weights


def _good_round(buffer: Buffer, rank: int) -> None:
    """A correct dispatch + combine: proves every rank is still in step after an error."""
    x, idx, w = _inputs(rank)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    num_local = recv_x.shape[0]
    scale = lambda e: 1.0 + e / 4.0  # noqa: E731 - expert e multiplies by its own factor (slots cannot swap unseen)
    factors = torch.tensor([scale(rank * num_local + j) for j in range(num_local)]).view(-1, 1, 1)
    out, _, _ = buffer.low_latency_combine((recv_x.float() * factors).to(torch.bfloat16), idx, w, handle)
    want = (x.float() * (w * scale(idx.float())).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def _dispatch_case(buffer: Buffer, rank: int, case: str):
    x, idx, w = _inputs(rank)
    num_max, num_experts, kwargs = N, E, {"use_fp8": False}
    bad = rank == 1
    if case == "too_many_tokens" and bad:
        x, idx, w = _inputs(rank, N + 1)
    elif case == "n_differs" and bad:
        num_max = N + 8
    elif case == "experts_differ" and bad:
        num_experts = 2 * E
    elif case == "x_dtype" and bad:
        x = x.to(torch.int32)
    elif case == "x_dims" and bad:
        x = x.view(1, *x.shape)
    elif case == "idx_dtype" and bad:
        idx = idx.float()
    elif case == "idx_range" and bad:
        idx[0, 0] = E
    elif case == "idx_negative" and bad:
        idx[0, 0] = -2
    elif case == "idx_rows" and bad:
        idx = idx[:-1]
    elif case == "idx_duplicate" and bad:
        idx[0, 1] = idx[0, 0]
    elif case == "experts_not_divisible":
        num_experts = E + 1
    elif case == "huge_n":  # on every rank: more than any device holds
        num_max = 2**40
    elif case == "huge_experts":
        num_experts = 2**40
    elif case == "hook_and_async" and bad:
        kwargs = {"use_fp8": False, "async_finish": True, "return_recv_hook": True}
    elif case == "hook_type" and bad:  # checked with async_finish False too
        kwargs = {"use_fp8": False, "return_recv_hook": 1}
    elif case == "ue8m0_without_round" and bad:
        kwargs = {"use_fp8": True, "use_ue8m0": True}
    elif case == "fp8_hidden" and bad:
        x, kwargs = x[:, :200], {"use_fp8": True}
    elif case == "stats_shape" and bad:
        kwargs["cumulative_local_expert_recv_stats"] = torch.zeros((E,), dtype=torch.int32)
    elif case == "hidden_differs" and bad:
        x = x[:, :128]
    elif case == "format_differs" and bad:
        kwargs = {"use_fp8": True}
    return buffer.low_latency_dispatch(x, idx, num_max, num_experts, **kwargs)


def _combine_case(buffer: Buffer, rank: int, case: str):
    x, idx, w = _inputs(rank)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    kwargs = {}
    bad = rank == 1
    if case == "logfmt" and bad:
        kwargs.update(use_logfmt=True, zero_copy=True)
    elif case == "x_shape" and bad:
        recv_x = recv_x[:, :-1]
    elif case == "weights_dtype" and bad:
        w = w.double()
    elif case == "out_dtype" and bad:
        kwargs["out"] = torch.empty((x.shape[0], H), dtype=torch.float32)
    elif case == "other_topk" and bad:
        idx = idx.roll(1, dims=0)  # same tokens, other experts per token: the counts no longer match
        idx[:, 1] = -1
    elif case == "other_dispatch":  # rank 1: the handle of a dispatch in which rank 0 sent it every token, so it
        skew = torch.tensor([E - 2, E - 1]).expand(idx.shape) if rank == 0 else idx  # returns rank 0 more rows
        other_x, _, other, _, _ = buffer.low_latency_dispatch(x, skew, N, E, use_fp8=False)  # than rank 0 expects
        recv_x, handle = (other_x, other) if bad else (recv_x, handle)
    elif case == "bad_layout_range" and bad:
        handle = (handle[0], torch.full_like(handle[1], (1 << 40) | 3), *handle[2:])
    return buffer.low_latency_combine(recv_x, idx, w, handle, **kwargs)


def _flat_case(buffer: Buffer, rank: int, case: str):
    x, idx, w = _inputs(rank)
    out, _, _ = buffer.low_latency_dispatch_flat(x, idx, N, E, topk_weights=w)
    handle = None if case == "flat_handle_none" and rank == 1 else out.handle
    return buffer.low_latency_combine_flat(out.expand_x, idx, w, handle)


_DISPATCH = {
    "too_many_tokens": "exceed num_max_dispatch_tokens_per_rank",
    "n_differs": "ranks disagree on num_max_dispatch_tokens_per_rank",
    "experts_differ": "ranks disagree on num_experts",
    "x_dtype": "x: dtype torch.int32 not supported",
    "x_dims": "x: must have 2 dims",
    "idx_dtype": "topk_idx: dtype torch.float32 not supported",
    "idx_range": f"contains {E}",
    "idx_negative": "contains -2",
    "idx_rows": "topk_idx: has 3 rows but x has 4 tokens",
    "idx_duplicate": "lists an expert twice",
    "experts_not_divisible": "not divisible by num_ranks",
    "huge_n": "num_max_dispatch_tokens_per_rank: recv_x (num_experts=8 x N=1099511627776 rows of hidden=256) needs",
    "huge_experts": "num_experts: recv_x (num_experts=1099511627776 x N=8 rows of hidden=256) needs",
    "hook_and_async": "cannot both be True",
    "hook_type": "return_recv_hook: must be a bool, got int 1",
    "ue8m0_without_round": "requires round_scale=True",
    "fp8_hidden": "must be a multiple of 128",
    "stats_shape": "cumulative_local_expert_recv_stats",
    "hidden_differs": "ranks disagree on hidden",
    "format_differs": "ranks disagree on",
}
_COMBINE = {
    "logfmt": "use_logfmt and zero_copy cannot both be True",
    "x_shape": "x: shape",
    "weights_dtype": "topk_weights: dtype torch.float64",
    "out_dtype": "out: dtype torch.float32",
    "other_topk": "pass the dispatch's handle and the same topk_idx",
    "other_dispatch": "rank 1 would return 8 rows to rank 0, which dispatched",
    "bad_layout_range": "handle.layout_range",
}
_FLAT = {"flat_handle_none": "handle: must be the FlatHandle"}


def _error_cases(info):
    return [_errors_on(info, t) for t in ("shm", "collective")]


def _errors_on(info, transport: str, skip: tuple[str, ...] = ()):
    buffer = Buffer(info.group, backend="reference", transport=transport)
    seen = {}
    for table, run in ((_DISPATCH, _dispatch_case), (_COMBINE, _combine_case), (_FLAT, _flat_case)):
        for case, message in ((c, m) for c, m in table.items() if c not in skip):
            with pytest.raises(MoeDistributeError) as err:
                run(buffer, info.rank, case)
            text = str(err.value)
            # the offending rank names the problem; the others learn that a peer rejected its input
            every = ("experts_not_divisible", "other_topk", "other_dispatch", "huge_n", "huge_experts")  # on every rank
            agreed = "ranks disagree" in message or case in every
            if info.rank == 1 or agreed:
                assert message in text, f"{case}: {text}"
            else:
                assert "rejected on rank 1" in text, f"{case}: {text}"
            seen[case] = text
            _good_round(buffer, info.rank)
    return sorted(seen)


def test_errors_reported_on_every_rank():
    results = parallel_launch(2, _error_cases, timeout=90)
    assert results[0] == results[1] == [sorted([*_DISPATCH, *_COMBINE, *_FLAT])] * 2  # shm, collective


_VALUES = ("idx_range", "idx_negative", "idx_duplicate")  # the checks that read topk_idx's values


def _errors_without_value_checks(info):
    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = "0"
    envs.check_values.cache_clear()  # (read once per process)
    return _errors_on(info, "collective", skip=_VALUES)


def test_shape_errors_reported_with_value_checks_off():
    """``DEEP_EP_NPU_CHECK_VALUES=0`` turns off the checks of topk_idx's values only: every other bad input (shapes,
    dtypes, sizes, handles) still raises on every rank."""
    want = sorted(c for c in [*_DISPATCH, *_COMBINE, *_FLAT] if c not in _VALUES)
    assert parallel_launch(2, _errors_without_value_checks, timeout=90) == [want] * 2


def _rdma_too_small(info):
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, info.world_size, E)
    buffer = Buffer(info.group, num_rdma_bytes=hint - 128 if info.rank == 0 else hint, backend="reference")
    x, idx, _ = _inputs(info.rank)
    with pytest.raises(MoeDistributeError) as err:
        buffer.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    return str(err.value)


def test_rdma_buffer_too_small_names_the_size():
    texts = parallel_launch(2, _rdma_too_small, timeout=60)
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, 2, E)
    assert f"{hint} bytes needed" in texts[0]
    assert "rejected on rank 0" in texts[1]


def test_size_hint_matches_deepep():
    # the two values quoted from DeepEP (LowLatencyLayout; PR #458's log line)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == 2_146_961_792
    assert Buffer.get_low_latency_rdma_size_hint(128, 3072, 16, 288) == 920_127_872
    assert Buffer.get_low_latency_ccl_buffer_size(8, 128, 7168, 256, 8) == 479


def test_constructor_errors():
    with pytest.raises(ValueError, match="group"):
        Buffer(None)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*'reference'"):
        Buffer(object(), backend="nope")
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer(object(), num_rdma_bytes=-1)
