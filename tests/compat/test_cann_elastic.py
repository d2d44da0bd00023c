"""CANN's own ``ElasticBuffer`` (``deep_ep_npu.cann``; ``cann_ops_transformer.ElasticBuffer`` under the sim) against an
oracle written here from the kernels' semantics (CANN's ``elastic_buffer.cpp``): rows by local expert, then (source
rank, token); ``recv_src_metadata`` ``[src_rank, src_token, k, slot]``; the per-token **unweighted** fp32 sum over k
ascending with one cast; the weights echoed back. Also worst-case sizing without CPU sync, cached handles, Engram
storage, the size hints, and bad input (on every rank). DeepEP V2's ``deep_ep_npu.ElasticBuffer`` stays importable.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.distributed import assert_named, op_error, parallel_launch
from tests.support.ops_oracle import from_bytes, to_bytes

N, H, E, K = 6, 128, 8, 3


def _inputs(w: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(w)
    out = []
    for r in range(w):
        bs = N - r % 2
        x = torch.randn((bs, H), generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)]).int()
        out.append((x, ids, torch.rand((bs, K), generator=g), torch.rand((bs, 4), generator=g)))
    return out


def _expert(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return (rows.float() * (experts.float().unsqueeze(1) + 1) / 4).bfloat16()


def _run(info, data: bytes):
    import deep_ep_npu
    from deep_ep_npu import sim

    sim.install()
    from cann_ops_transformer import ElasticBuffer

    assert ElasticBuffer is not deep_ep_npu.ElasticBuffer  # both exist
    w, r = info.world_size, info.rank
    x, ids, weights, sf = from_bytes(data)[r]
    buf = ElasticBuffer(info.group, num_cpu_bytes=2 << 20, num_max_tokens_per_rank=N, hidden=H, num_topk=K)
    recv_x, none, recv_w, h = buf.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=E)
    experts = torch.repeat_interleave(torch.arange(E // w) + r * (E // w), h.num_recv_tokens_per_expert)
    y = _expert(recv_x, experts)
    combined, combined_w = buf.combine(y, h, topk_weights=recv_w)
    # worst case: A = W * N * min(K, L), the real rows first
    wx, _, ww, wh = buf.dispatch(x, topk_idx=ids, topk_weights=weights, num_experts=E, do_cpu_sync=False)
    n = int(h.num_recv_tokens_per_expert.sum())
    worst = (
        wx.shape[0] == w * N * min(K, E // w),
        torch.equal(wx[:n], recv_x),
        torch.equal(ww[:n], recv_w),
        torch.equal(wh.recv_src_metadata[:n], h.recv_src_metadata),
    )
    # pre-quantized x: (fp8 e4m3fn data, fp32 scales) travel together
    (qx, qsf), *_ = buf.dispatch((x.to(torch.float8_e4m3fn), sf), topk_idx=ids, num_experts=E)
    # cached: a new x lands at the same rows, no weights
    cx, _, cw, ch = buf.dispatch(x * 2, handle=h)
    cached = (ch is h, cw is None, torch.equal(cx, (recv_x.float() * 2).bfloat16()))
    # Engram: rank r's table holds 10 * r + row in every element
    table = (torch.arange(4, dtype=torch.float32).unsqueeze(1) + 10 * r).expand(4, H).contiguous().bfloat16()
    buf.engram_write(table)
    fetch = buf.engram_fetch(torch.tensor([0, 4 * w - 1, 5, 4 * w, -1], dtype=torch.int32))
    errors = {"pending": _raises(lambda: buf.engram_fetch(torch.zeros(1, dtype=torch.int32)))}
    fetched = fetch()
    other = ElasticBuffer(info.group)
    errors |= {
        "ids": op_error(lambda: buf.dispatch(x, topk_idx=ids.long(), num_experts=E)),
        "one_rank": op_error(lambda: buf.dispatch(x, topk_idx=ids.long() if r else ids, num_experts=E)),
        "align": op_error(lambda: buf.dispatch(x, topk_idx=ids, num_experts=E, expert_alignment=2)),
        "experts": op_error(lambda: buf.dispatch(x, topk_idx=ids, num_experts=2 * w + 1)),
        "bias": op_error(lambda: buf.combine(y, h, bias=x)),
        "handle": op_error(lambda: buf.dispatch(x, topk_idx=ids, handle=h)),
        "foreign": op_error(lambda: other.combine(y, h)),
        "no_moe": op_error(lambda: other.dispatch(x, topk_idx=ids, num_experts=E)),
        "indices": op_error(lambda: buf.engram_fetch(torch.zeros(2, dtype=torch.int64))),
        "storage": op_error(lambda: buf.engram_write(torch.zeros(4, 100))),
        "too_big": op_error(lambda: buf.engram_write(torch.zeros(8192, 128))),
    }
    buf.barrier()
    buf.destroy()
    buf.destroy()
    errors["destroyed"] = _raises(lambda: buf.dispatch(x, topk_idx=ids, num_experts=E))
    other.destroy()
    h = dataclasses.replace(h, v2=None)  # (the DeepEP V2 handle holds the group)
    return to_bytes(
        (recv_x, none, recv_w, h, combined, combined_w, worst, cached, fetched, errors, qx.view(torch.uint8), qsf)
    )


def _raises(fn) -> str:
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("world_size", [2, 4])
def test_cann_elastic_buffer(world_size):
    inputs = _inputs(world_size)
    results = [from_bytes(b) for b in parallel_launch(world_size, _run, to_bytes(inputs), timeout=90)]
    num_local = E // world_size
    for r, (recv_x, none, recv_w, h, combined, combined_w, worst, cached, fetched, errors, qx, qsf) in enumerate(
        results
    ):
        # dispatch oracle: per local expert, per source rank, tokens ascending
        rows, meta, weights, per_expert, scales = [], [], [], [], []
        for e in range(r * num_local, (r + 1) * num_local):
            count = 0
            for src, (x, ids, w, sf) in enumerate(inputs):
                to_me = [t for t in range(ids.shape[0]) if any(int(i) // num_local == r for i in ids[t])]
                for t in range(ids.shape[0]):
                    hits = (ids[t] == e).nonzero().flatten().tolist()
                    if hits:
                        rows.append(x[t])
                        scales.append(sf[t])
                        meta.append([src, t, hits[0], to_me.index(t)])
                        weights.append(float(w[t, hits[0]]))
                        count += 1
            per_expert.append(count)
        assert none is None and torch.equal(recv_x, torch.stack(rows)), r
        fp8_rows = torch.stack(rows).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(qx, fp8_rows) and torch.equal(qsf, torch.stack(scales)), r
        assert h.recv_src_metadata.tolist() == meta and torch.equal(recv_w, torch.tensor(weights)), r
        assert h.num_recv_tokens_per_expert.tolist() == per_expert and h.num_recv_tokens_per_expert.dtype == torch.int64
        got_tokens = [
            sum(any(int(i) // num_local == r for i in ids[t]) for t in range(ids.shape[0])) for _, ids, *_ in inputs
        ]
        assert h.num_recv_tokens_per_rank.tolist() == got_tokens and h.num_recv_tokens == sum(got_tokens)
        x, ids, w, _ = inputs[r]
        slots = [
            [
                [
                    t2
                    for t2 in range(ids.shape[0])
                    if any(int(i) // num_local == int(ids[t, k]) // num_local for i in ids[t2])
                ].index(t)
                for k in range(K)
            ]
            for t in range(ids.shape[0])
        ]
        assert h.dst_buffer_slot_idx.tolist() == slots and torch.equal(h.topk_idx, ids)
        # combine oracle: the unweighted fp32 sum over k ascending, one cast; weights echoed
        want = torch.stack(
            [sum(_expert(x[t : t + 1], ids[t, k : k + 1])[0].float() for k in range(K)) for t in range(x.shape[0])]
        ).bfloat16()
        assert torch.equal(combined, want) and torch.equal(combined_w, w), r
        assert all(worst) and all(cached), (r, worst, cached)
        want_fetch = [0, 10 * (world_size - 1) + 3, 10 * (5 // 4) + 1, 0, 0]
        assert fetched.dtype == torch.bfloat16 and fetched.shape == (5, H)
        assert fetched[:, 0].float().tolist() == want_fetch and bool((fetched == fetched[:, :1]).all())
        assert "not run yet" in errors["pending"] and "after destroy" in errors["destroyed"]
        expected = {
            "ids": "topk_idx",
            "align": "expert_alignment",
            "experts": "num_experts",
            "bias": "bias",
            "handle": "handle",
            "foreign": "handle",
            "no_moe": "num_max_tokens_per_rank",
            "indices": "indices",
            "storage": "storage",
            "too_big": "storage",
        }
        assert_named(errors, expected, r, "topk_idx")  # rank 1's bad topk_idx: rank 0 raises too


def test_cann_elastic_size_hints():
    from deep_ep_npu.cann import ElasticBuffer

    assert ElasticBuffer.get_moe_ep_ccl_buffer_size(8, 128, 7168, 256, 8) == 15
    assert ElasticBuffer.get_moe_ep_ccl_buffer_size(16, 256, 4096, 256, 8) == 27
    assert ElasticBuffer.get_engram_storage_size_hint(1000, 256, torch.float32) == 2 << 20
    assert ElasticBuffer.get_engram_storage_size_hint(3000, 384) == 4 << 20  # 3000 * 768 B -> 2 x 2 MiB
    with pytest.raises(ValueError, match="hidden"):
        ElasticBuffer.get_engram_storage_size_hint(10, 100)
