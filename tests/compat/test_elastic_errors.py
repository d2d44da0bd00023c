"""``ElasticBuffer``: bad input and broken cached-handle rules raise a clear error on every rank (never a hang),
the group stays usable after it, and a peer that stops calling is detected (``EPRankFailure``), cached calls
included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import ElasticBuffer, MoeDistributeError
from tests.support.distributed import parallel_launch, stop_victim, survivor_failure

N, H, E, K = 8, 128, 8, 3


def _inputs(rank: int, num_tokens: int = 6):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((num_tokens, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)])
    return x, idx, torch.rand((num_tokens, K), generator=g)


def _good_round(buf: ElasticBuffer, rank: int, r: int) -> None:
    """A fresh dispatch, a cached one and a combine, checked: every rank is still in step."""
    x, idx, w = _inputs(rank)
    recv_x, recv_idx, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=N)
    again, *_ = buf.dispatch(x * 2, handle=handle)
    assert torch.equal(again, recv_x * 2)
    combined, _, _ = buf.combine(recv_x, handle)  # each token comes back once per rank it went to
    ranks = torch.tensor([len(set((row // (E // r)).tolist())) for row in idx], dtype=torch.float32)
    assert torch.equal(combined, (x.float() * ranks.unsqueeze(1)).to(torch.bfloat16))


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except MoeDistributeError as err:
        return err.param, str(err)
    raise AssertionError("no MoeDistributeError")


DISPATCH_CASES = {  # case -> kwargs of rank 1's dispatch (fresh); rank 0's call is valid
    "idx_range": lambda x, idx, w, h: dict(x=x, topk_idx=idx.masked_fill(idx == idx[0, 0], E), num_experts=E),
    "idx_duplicate": lambda x, idx, w, h: dict(
        x=x, topk_idx=torch.cat([idx[:, :1], idx[:, :1], idx[:, 2:]], 1), num_experts=E
    ),
    "too_many_tokens": lambda x, idx, w, h: dict(x=torch.cat([x, x]), topk_idx=torch.cat([idx, idx]), num_experts=E),
    "weights_shape": lambda x, idx, w, h: dict(x=x, topk_idx=idx, topk_weights=w[:, :1], num_experts=E),
    "no_num_experts": lambda x, idx, w, h: dict(x=x, topk_idx=idx),
    "fp8_sf_rows": lambda x, idx, w, h: dict(
        x=(x.to(torch.float8_e4m3fn), torch.ones((1, 1))), topk_idx=idx, num_experts=E
    ),
    "zero_padding_without_expand": lambda x, idx, w, h: dict(x=x, topk_idx=idx, num_experts=E, do_zero_padding=True),
    "previous_event_type": lambda x, idx, w, h: dict(
        x=x, topk_idx=idx, num_experts=E, previous_event=object(), allocate_on_comm_stream=True
    ),
    "n_differs": lambda x, idx, w, h: dict(x=x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=2 * N),
    "hidden_differs": lambda x, idx, w, h: dict(x=torch.cat([x, x], 1), topk_idx=idx, num_experts=E),
}
CACHED_CASES = {  # case -> kwargs of rank 1's cached dispatch (DeepEP's reuse rules)
    "topk_idx_given": lambda x, idx, w, h: dict(x=x, topk_idx=idx, handle=h),
    "tokens_differ": lambda x, idx, w, h: dict(x=x[:-1], handle=h),
    "num_experts_differs": lambda x, idx, w, h: dict(x=x, handle=h, num_experts=2 * E),
    "alignment_differs": lambda x, idx, w, h: dict(x=x, handle=h, expert_alignment=4),
    "n_differs": lambda x, idx, w, h: dict(x=x, handle=h, num_max_tokens_per_rank=2 * N),
    "do_expand_differs": lambda x, idx, w, h: dict(x=x, handle=h, do_expand=True),
    "cpu_sync": lambda x, idx, w, h: dict(x=x, handle=h, do_cpu_sync=True),
    "stats": lambda x, idx, w, h: dict(x=x, handle=h, cumulative_local_expert_recv_stats=torch.zeros(4).int()),
    "weights_shape": lambda x, idx, w, h: dict(x=x, handle=h, topk_weights=w[:, :2]),
    "hidden_differs": lambda x, idx, w, h: dict(x=torch.cat([x, x], 1), handle=h),
    "x_dtype_differs": lambda x, idx, w, h: dict(x=x.half(), handle=h),
}
COMBINE_CASES = {  # case -> kwargs of rank 1's combine
    "x_rows": lambda rx, h, w: dict(x=rx[:-1], handle=h),
    "x_dtype": lambda rx, h, w: dict(x=rx.to(torch.int32), handle=h),
    "weights_shape": lambda rx, h, w: dict(x=rx, handle=h, topk_weights=w[:, :1]),
    "bias_shape": lambda rx, h, w: dict(x=rx, handle=h, bias=torch.zeros((1, H), dtype=torch.bfloat16)),
    "three_biases": lambda rx, h, w: dict(x=rx, handle=h, bias=(rx[:1], rx[:1], rx[:1])),
    "not_a_handle": lambda rx, h, w: dict(x=rx, handle=(1, 2)),
    "weights_on_one_rank": lambda rx, h, w: dict(x=rx, handle=h),  # valid, but rank 0 passes weights
}


def _errors(info):
    rank, r = info.rank, info.world_size
    buf = ElasticBuffer(info.group, num_max_tokens_per_rank=N, explicitly_destroy=True, backend="reference")
    other = ElasticBuffer(info.group, num_max_tokens_per_rank=N, explicitly_destroy=True, backend="reference")
    x, idx, w = _inputs(rank)
    seen: dict[str, tuple[str, str]] = {}
    for name, make in DISPATCH_CASES.items():
        kwargs = make(x, idx, w, None) if rank == 1 else dict(x=x, topk_idx=idx, num_experts=E)
        seen[f"dispatch/{name}"] = _error(lambda kw=kwargs: buf.dispatch(**kw))
        _good_round(buf, rank, r)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    for name, make in CACHED_CASES.items():
        kwargs = make(x, idx, w, handle) if rank == 1 else dict(x=x, handle=handle)
        seen[f"cached/{name}"] = _error(lambda kw=kwargs: buf.dispatch(**kw))
        _good_round(buf, rank, r)
    foreign = other.dispatch(x, idx, num_experts=E)[3]  # on every rank: a handle of another buffer
    seen["cached/foreign_handle"] = _error(lambda: buf.dispatch(x, handle=foreign))
    _good_round(buf, rank, r)
    # across ranks: rank 1 alone reuses a handle / passes another buffer's / passes another dispatch's
    mixed = dict(x=x, handle=handle) if rank == 1 else dict(x=x, topk_idx=idx, num_experts=E)
    seen["cross/mixed"] = _error(lambda: buf.dispatch(**mixed))
    _good_round(buf, rank, r)
    one_foreign = dict(x=x, handle=foreign if rank == 1 else handle)
    seen["cross/one_foreign"] = _error(lambda: buf.dispatch(**one_foreign))
    _good_round(buf, rank, r)
    # another dispatch: rank 1 keeps its tokens (sends rank 0 none), rank 0 routes as before; rank 1 passes its
    # handle, rank 0 the first one, so rank 0 expects rows rank 1 does not send (found after the payload, on both)
    own = (torch.arange(K) + rank * (E // r)).expand(x.shape[0], K).contiguous()
    skewed_x, _, _, skewed, _ = buf.dispatch(x, own if rank == 1 else idx, num_experts=E)
    other_dispatch = dict(x=x, handle=skewed if rank == 1 else handle)
    seen["cross/other_dispatch"] = _error(lambda: buf.dispatch(**other_dispatch))
    _good_round(buf, rank, r)
    # the other way round, rank 1 sends rank 0 more rows than its handle expects (none): on gloo a longer message
    # than the receive posted would abort rank 0, so the early payload's receive is posted at a bound
    reversed_handles = dict(x=x, handle=skewed if rank == 0 else handle)
    seen["cross/other_dispatch_reversed"] = _error(lambda: buf.dispatch(**reversed_handles))
    _good_round(buf, rank, r)
    # its combine: rank 0 returns rank 1 the rows of the first dispatch, more than rank 1's handle expects (none)
    other_combine = dict(x=skewed_x, handle=skewed) if rank == 1 else dict(x=recv_x, handle=handle)
    seen["cross/other_dispatch_combine"] = _error(lambda: buf.combine(**other_combine))
    _good_round(buf, rank, r)
    for name, make in COMBINE_CASES.items():
        # rank 0 passes weights: its combine runs a second exchange, which a rejection must stop before it starts
        kwargs = make(recv_x, handle, recv_w) if rank == 1 else dict(x=recv_x, handle=handle, topk_weights=recv_w)
        seen[f"combine/{name}"] = _error(lambda kw=kwargs: buf.combine(**kw))
        _good_round(buf, rank, r)
    other.destroy()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.dispatch(x, idx, num_experts=E)
    return seen


def _constructor(info):
    r = info.world_size
    every_keyword = dict(
        num_bytes=4 << 20,
        num_cpu_bytes=0,
        num_max_tokens_per_rank=N,
        hidden=H,
        num_topk=K,
        use_fp8_dispatch=True,
        deterministic=True,
        allow_hybrid_mode=False,
        allow_multiple_reduction=True,
        prefer_overlap_with_compute=False,
        sl_idx=0,
        num_allocated_qps=4,
        num_cpu_timeout_secs=10,
        num_gpu_timeout_secs=10,
        explicitly_destroy=True,
    )
    buf = ElasticBuffer(info.group, **every_keyword, backend="reference")
    _good_round(buf, info.rank, r)
    hint = ElasticBuffer.get_buffer_size_hint(info.group, N, H, K, use_fp8_dispatch=True)
    sms = (buf.get_theoretical_num_sms(E, K), ElasticBuffer(info.group).get_theoretical_num_sms(E, K))
    out = dict(
        hint=hint,
        sms=sms,
        qps=buf.get_theoretical_num_qps(sms[0]),
        domain=buf.get_logical_domain_size(),
        stream=buf.get_comm_stream(),
    )
    out["handle_num_sms"] = buf.dispatch(*_inputs(info.rank)[:2], num_experts=E)[3].num_sms
    buf.barrier()
    buf.destroy()
    for bad in (dict(num_bytes=(2 << 20) + 1), dict(hidden=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ElasticBuffer(info.group, **bad)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        ElasticBuffer(info.group).destroy()
    return out


def test_constructor_and_helpers():
    for res in parallel_launch(2, _constructor, timeout=60):
        token_bytes = H + 4 * (H // 32) + 12 * K + 8  # the documented fp8 model
        assert res["hint"] % (2 << 20) == 0 and res["hint"] >= 2 * N * token_bytes
        assert res["sms"] == (64, 20) and res["qps"] == 9 and res["domain"] == (1, 2) and res["stream"] is None
        assert res["handle_num_sms"] == 64  # num_sms=0: the theoretical count, stored in the handle


def test_errors_on_every_rank():
    results = parallel_launch(2, _errors, timeout=120)
    assert results[0].keys() == results[1].keys()
    want_param = {
        "dispatch/idx_range": "topk_idx",
        "dispatch/idx_duplicate": "topk_idx",
        "dispatch/too_many_tokens": "x",
        "dispatch/weights_shape": "topk_weights",
        "dispatch/no_num_experts": "num_experts",
        "dispatch/fp8_sf_rows": "x[1]",
        "dispatch/zero_padding_without_expand": "do_zero_padding",
        "dispatch/previous_event_type": "previous_event",
        "cached/topk_idx_given": "topk_idx",
        "cached/tokens_differ": "x",
        "cached/num_experts_differs": "num_experts",
        "cached/alignment_differs": "expert_alignment",
        "cached/n_differs": "num_max_tokens_per_rank",
        "cached/do_expand_differs": "do_expand",
        "cached/cpu_sync": "do_cpu_sync",
        "cached/stats": "cumulative_local_expert_recv_stats",
        "cached/weights_shape": "topk_weights",
        "cached/hidden_differs": "x",
        "cached/x_dtype_differs": "x",
        "combine/x_rows": "x",
        "combine/x_dtype": "x",
        "combine/weights_shape": "topk_weights",
        "combine/bias_shape": "bias",
        "combine/three_biases": "bias",
        "combine/not_a_handle": "handle",
    }
    for case, (param, message) in results[1].items():  # the rank with the bad input names it
        if case in want_param:
            assert param == want_param[case], (case, message)
    for case in want_param:  # its peer learns of it through the agreement step, before any payload moves
        param, message = results[0][case]
        assert param == "inputs" and "rejected on rank 1" in message, (case, message)
    # valid on each rank, inconsistent across them
    for case in ("dispatch/n_differs", "dispatch/hidden_differs", "combine/weights_on_one_rank"):
        assert all("ranks disagree on" in res[case][1] for res in results), results[0][case]
    assert all("another ElasticBuffer" in res["cached/foreign_handle"][1] for res in results)
    # a handle on one rank only, or handles of different dispatches: every rank raises, none waits for a timeout
    assert all("ranks disagree on cached handle" in res["cross/mixed"][1] for res in results)
    assert results[1]["cross/one_foreign"][0] == "handle" and "rejected on rank 1" in results[0]["cross/one_foreign"][1]
    assert all(
        res["cross/other_dispatch"][0] == "handle"
        and "the handle of the same dispatch" in res["cross/other_dispatch"][1]
        for res in results
    )
    assert all(
        res["cross/other_dispatch_reversed"][0] == "handle"
        and "rank 1's handle sends" in res["cross/other_dispatch_reversed"][1]
        for res in results
    )
    assert all(
        res["cross/other_dispatch_combine"][0] == "handle"
        and "rank 0 would return" in res["cross/other_dispatch_combine"][1]
        for res in results
    )


def _peer_stops(info, where: str):
    store = dist.distributed_c10d._get_default_store()
    buf = ElasticBuffer(info.group, num_max_tokens_per_rank=N, backend="reference", timeout=3.0)
    x, idx, w = _inputs(info.rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    if info.rank == 1:
        stop_victim(store, "exit")
    call = (lambda: buf.dispatch(x, handle=handle)) if where == "cached" else (lambda: buf.combine(recv_x, handle))
    return survivor_failure(store, info.rank, info.world_size - 1, call)


@pytest.mark.parametrize("where", ["cached", "combine"])
def test_peer_failure_detected(where):
    results = parallel_launch(2, _peer_stops, where, timeout=60, allow_exit=(1,))
    missing, elapsed = results[0]
    assert list(missing) == [1] and elapsed < 3.0 * 3
