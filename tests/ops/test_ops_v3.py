"""The V3 context ops and CANN's ``MoeDistributeBuffer`` against the ``_v2`` ops (the oracle: every ``_v2`` output is
checked against independent references in test_ops_extended / test_ops_platforms): the same inputs through
``moe_distribute_dispatch_v2`` -> an expert -> ``combine_v2``, through ``dispatch_v3`` / ``combine_v3`` with a
context (new and old layout), and through ``MoeDistributeBuffer.low_latency_*`` (and its ``npu_`` spellings) give
bit-equal outputs at EP 2, 4 and 8 (small) with quant modes 0 / 2 (smooth scales) / 3 / 4 / 5, 1D / 2D masks,
shared-expert ranks, zero / copy / const experts, elastic_info, comm_quant_mode 2 and an empty expert_scales (plain
sum). Then the context form's errors, on every rank before any communication.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.ops.test_ops_extended import make_case
from tests.support.distributed import error_mismatches, op_error, parallel_launch
from tests.support.ops_oracle import expert_fn, from_bytes, to_bytes


def _in_inference_mode(info, data: bytes):
    """The V3 ops inside ``torch.inference_mode()`` (as a server's forward runs them): a context made there is an
    inference tensor (it has no version counter); it is read once, and again after ``create_context(out=)``."""
    from deep_ep_npu.cann import MoeDistributeBuffer
    from deep_ep_npu.ops import create_context

    buf = MoeDistributeBuffer(info.group, ccl_buffer_size=64, comm_alg=0)
    ((case, extra),) = from_bytes(data)
    want = _flow(info, case, "v2", None, buf, extra)
    with torch.inference_mode():
        ctx = create_context(info.group)
        assert ctx.is_inference()
        for rewrite in (False, False, True):
            if rewrite:
                create_context(info.group, out=ctx)
            assert torch.equal(_flow(info, case, "v3", ctx, buf, extra)[1], want[1])
    return True


def test_v3_ops_in_inference_mode():
    assert parallel_launch(2, _in_inference_mode, to_bytes(CASES[2][:1]), timeout=120) == [True, True]


SHAPE, PARAM, NULL = 561002, 161002, 161001


def _flow(info, case: dict, how: str, ctx, buf, extra: dict):
    """dispatch -> expert -> combine of ``case`` on this rank by ``how`` ("v2", "v3" or "buffer")."""
    from deep_ep_npu import ops

    inp, sp, lay = case["inputs"][info.rank], case["specials"][info.rank], case["lay"]
    w, r, e = info.world_size, info.rank, case["attr_experts"]
    dkw = dict(case["dkw"], x_active_mask=inp.mask)
    qkw = dict(extra.get("quant", {"quant_mode": 2 if case["quant"] else 0}))
    weights = torch.empty(0) if extra.get("plain_sum") else inp.weights
    if how == "buffer":
        bkw = {k: v for k, v in dkw.items() if k != "global_bs"}
        n = dkw["global_bs"] // w
        disp = buf.low_latency_dispatch if r % 2 else buf.npu_low_latency_dispatch
        outs = disp(
            inp.x,
            inp.ids,
            e,
            x_smooth_scale=case["smooth"],
            num_max_dispatch_tokens_per_rank=n,
            topk_weights=extra.get("expert_scales") and inp.weights,
            **bkw,
            **qkw,
        )
        outs = (*outs[:5], None, outs[5])
    elif how == "v3":
        outs = ops.moe_distribute_dispatch_v3(
            ctx,
            inp.x,
            inp.ids,
            w,
            r,
            e,
            buf.ccl_buffer_size,
            scales=case["smooth"],
            expert_scales=extra.get("expert_scales") and inp.weights,
            **dkw,
            **qkw,
        )
    else:
        outs = ops.moe_distribute_dispatch_v2(
            inp.x,
            inp.ids,
            info.group,
            w,
            r,
            e,
            scales=case["smooth"],
            expert_scales=extra.get("expert_scales") and inp.weights,
            **dkw,
            **qkw,
        )
    expand_x, dyn, assist, nums, counts = outs[:5]
    n = int(nums.sum())
    ids = torch.tensor([lay.expert_of_rank(r, j) for j in range(nums.numel())], dtype=torch.int64)
    rows = expand_x[:n].float() * (dyn[:n].float().unsqueeze(1) if qkw["quant_mode"] == 2 else 1)
    y = torch.zeros((expand_x.shape[0], expand_x.shape[1]), dtype=case["dtype"])
    y[:n] = expert_fn(rows.to(case["dtype"]), torch.repeat_interleave(ids, nums))
    special = {} if not lay.copy and not lay.const else dict(ori_x=sp["ori_x"])
    if lay.const:
        special.update(const_expert_alpha_1=sp["alpha_1"], const_expert_alpha_2=sp["alpha_2"], const_expert_v=sp["v"])
    ckw = dict(shared_expert_x=inp.shared_x, comm_quant_mode=2 if case["comm_quant"] else 0, **dkw, **special)
    if how == "buffer":
        ckw["expert_shared_type"], n_max = 0, ckw.pop("global_bs") // w
        comb = buf.low_latency_combine if r % 2 == 0 else buf.npu_low_latency_combine
        combined = comb(
            y,
            inp.ids,
            None if extra.get("plain_sum") else weights,
            assist,
            counts,
            num_experts=e,
            num_max_dispatch_tokens_per_rank=n_max,
            **ckw,
        )
    elif how == "v3":
        combined = ops.moe_distribute_combine_v3(
            ctx, y, inp.ids, assist, counts, weights, w, r, e, buf.ccl_buffer_size, **ckw
        )
    else:
        combined = ops.moe_distribute_combine_v2(y, inp.ids, assist, counts, weights, info.group, w, r, e, **ckw)
    return [t for t in outs if t is not None], combined


def _parity(info, data: bytes):
    from deep_ep_npu.cann import MoeDistributeBuffer
    from deep_ep_npu.ops import create_context

    buf = MoeDistributeBuffer(info.group, ccl_buffer_size=64, comm_alg=0)
    old = create_context(info.group, "old")
    checked = 0
    for case, extra in from_bytes(data):
        ctx = old if extra.get("old") else buf.context
        want = _flow(info, case, "v2", None, buf, extra)
        for how in ("v3", "buffer"):
            got = _flow(info, case, how, ctx, buf, extra)
            keep = [0, 1, 2, 3, 4, 6] if how == "buffer" else range(7)  # the Buffer drops tp_recv_counts
            for i, (a, b) in enumerate(zip(got[0], [want[0][k] for k in keep], strict=True)):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (how, i, extra)
            assert torch.equal(got[1], want[1]), (how, "combined", extra)
            checked += 1
    return checked


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CASES = {
    2: [
        (make_case(1, 2, quant=True, smooth=True, mask="1d", uneven=True), {"expert_scales": True}),
        (make_case(2, 2, special=(1, 1, 1), mask="2d", comm_quant=True, hidden=16), {"old": True}),
        (make_case(3, 2, quant=False, hidden=32), {"quant": {"quant_mode": 4, "y_dtype": E4M3}, "plain_sum": True}),
        (make_case(4, 2, quant=False, hidden=32, mask="1d"), {"quant": {"quant_mode": 5, "y_dtype": 291}}),
    ],
    4: [
        (make_case(5, 4, sr=1, s=1, quant=True, smooth=True, mask="2d"), {"expert_scales": True}),
        (make_case(6, 4, table1=[0, 1, -1, 2], new_sr=0, quant=True, smooth=False), {}),
        (make_case(9, 4, quant=False, hidden=32, mask="2d"), {"quant": {"quant_mode": 3, "y_dtype": E5M2}}),
        (make_case(7, 4, sr=2, s=2, special=(1, 0, 1), uneven=True), {"plain_sum": True, "old": True}),
    ],
    8: [(make_case(8, 8, sr=2, s=1, quant=True, smooth=True, mask="1d", max_bs=2, local=1), {"expert_scales": True})],
}


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_v3_ops_and_buffer_equal_v2(world_size):
    cases = CASES[world_size]
    done = parallel_launch(world_size, _parity, to_bytes(cases), timeout=120)
    assert done == [2 * len(cases)] * world_size


def _errors(info):
    from deep_ep_npu.cann import MoeDistributeBuffer
    from deep_ep_npu.ops import create_context, moe_distribute_combine_v3, moe_distribute_dispatch_v3

    w, r = info.world_size, info.rank
    buf = MoeDistributeBuffer(info.group)
    x, ids = torch.ones((2, 1024), dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ccl = buf.ccl_buffer_size
    peer_ctx = [None] * w
    dist.all_gather_object(peer_ctx, buf.context)
    subs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sub_ctx = create_context(subs[r // 2])

    def disp(ctx=buf.context, xx=x, ii=ids, **kw):
        a = dict(ep_world_size=w, ep_rank_id=r, moe_expert_num=8, ccl_buffer_size=ccl) | kw
        return op_error(lambda: moe_distribute_dispatch_v3(ctx, xx, ii, **a))

    out = {
        "peer": disp(peer_ctx[(r + 1) % w]),
        "sub": disp(sub_ctx),
        "garbage": disp(torch.zeros(4100, dtype=torch.int32)),
        "dtype": disp(buf.context.long()),
        "length": disp(buf.context[:100]),
        "rank": disp(ep_rank_id=(r + 1) % w),
        "too_small": disp(ccl_buffer_size=1 << 20),
        "too_big": disp(ccl_buffer_size=ccl + 1),
        "tp": disp(tp_world_size=2),
        "hierarchy": disp(comm_alg="hierarchy"),
        "ids": disp(ii=ids.float()),
        "buffer_ids": op_error(lambda: buf.low_latency_dispatch(x, ids.float(), 8)),
        "buffer_experts": op_error(lambda: buf.low_latency_dispatch(x, ids, 7)),
        "buffer_update": op_error(lambda: buf.update_ctx(subs[r // 2])),
        "combine_ctx": op_error(
            lambda: moe_distribute_combine_v3(
                peer_ctx[(r + 1) % w],
                x,
                ids,
                torch.zeros(6, dtype=torch.int32),
                torch.zeros(8, dtype=torch.int32),
                torch.ones(2, 2),
                w,
                r,
                8,
                ccl,
            )
        ),
        "buffer_assist": op_error(
            lambda: buf.low_latency_combine(x, ids, None, None, torch.zeros(8, dtype=torch.int32), num_experts=8)
        ),
        # one rank's bad input: every rank raises, the others naming the rank that rejected
        "one_ccl": disp(ccl_buffer_size=1 << 20 if r == 1 else ccl),
        "one_ctx": disp(peer_ctx[(r + 1) % w] if r == 2 else buf.context),
        "one_buffer": op_error(lambda: buf.low_latency_dispatch(x, ids.float() if r == 3 else ids, 8)),
        "one_gbs": disp(global_bs="8" if r == 1 else 0),  # used for the CCL size check: validated first
    }
    ctx_before = buf.context
    same = dist.new_group(list(range(w)))
    assert buf.update_ctx(same) and buf.context is ctx_before and buf.group is same
    moe_distribute_dispatch_v3(buf.context, x, ids, w, r, 8, ccl)  # the rebuilt context works on the new group
    return out


ERRORS = {
    "peer": (SHAPE, "context", "built for rank"),
    "sub": (SHAPE, "ep_world_size", "communicator has 2 ranks"),
    "garbage": (PARAM, "context", "names no communicator"),
    "dtype": (PARAM, "context", "torch.int32"),
    "length": (SHAPE, "context", "[2052, 4100]"),
    "rank": (SHAPE, "ep_rank_id", "context is rank"),
    "too_small": (SHAPE, "ccl_buffer_size", "bytes are needed"),
    "too_big": (SHAPE, "ccl_buffer_size", "exceeds the context's CCL buffer"),
    "tp": (PARAM, "tp_world_size", "no TP communicator"),
    "hierarchy": (PARAM, "comm_alg", "context mode"),
    "ids": (PARAM, "expert_ids", "float32"),
    "buffer_ids": (PARAM, "topk_idx", "float32"),
    "buffer_experts": (SHAPE, "num_experts", "not divisible"),
    "buffer_update": (SHAPE, "new_group", "world size must stay 4"),
    "combine_ctx": (SHAPE, "context", "built for rank"),
    "buffer_assist": (NULL, "assist_info_for_combine", "None"),
}


ONE_RANK = {
    "one_ccl": (1, "ccl_buffer_size"),
    "one_ctx": (2, "context"),
    "one_buffer": (3, "topk_idx"),
    "one_gbs": (1, "global_bs"),
}


def test_v3_errors_on_every_rank():
    """Wrong context (a peer's, a subgroup's, garbage, dtype, length), ep_rank_id, ccl_buffer_size too small / above
    the context's, TP 2, hierarchy, bad ids (naming the op's and the Buffer's parameter), a Buffer update to another
    world size, a missing assist_info: each a MoeDistributeError on every rank, also when one rank alone is wrong; then
    update_ctx works in place."""
    for rank, got in enumerate(parallel_launch(4, _errors, timeout=90)):
        wrong = error_mismatches(rank, got, ERRORS)
        assert not wrong, "\n".join(wrong)
        for name, (bad, param) in ONE_RANK.items():
            want = (param, "") if rank == bad else ("inputs", f"rejected on rank {bad}")
            assert got[name] is not None and got[name][1] == want[0] and want[1] in got[name][2], (
                rank,
                name,
                got[name],
            )
    assert "bytes are needed" in got["too_small"][2]
