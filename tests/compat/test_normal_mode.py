"""DeepEP's normal mode on ``Buffer`` (``dispatch`` / ``combine``) bit for bit against
:mod:`tests.support.normal_oracle`: bf16 and fp8 rows, with and without top-k, a cached handle, ``async_finish``,
``num_worst_tokens``, ``bias``, ``expert_alignment``, ranks with no tokens; and bad input raising the same clear error
on every rank."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import Buffer, Config, MoeDistributeError
from tests.support import normal_oracle as oracle
from tests.support.distributed import parallel_launch

H, K, E = 256, 3, 8


def _tokens(rank: int) -> int:
    return [6, 9, 0, 5][rank % 4]  # different per rank; rank 2 has none


def _all(r: int, seed: int):
    got = [oracle.inputs(p, _tokens(p), H, K, E, seed) for p in range(r)]
    return [g[0] for g in got], [g[1] for g in got], [g[2] for g in got]


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = x.float().view(x.shape[0], x.shape[1] // 128, 128)
    scale = g.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    data = (g / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape)
    return data, scale.t().contiguous().t()  # column-major scales, as DeepEP's test passes them


def _check_rows(got, want_x, fp8: bool) -> None:
    if fp8:
        assert torch.equal(got[0].view(torch.uint8), want_x[0].view(torch.uint8))
        assert torch.equal(got[1], want_x[1])
    else:
        assert torch.equal(got, want_x)


def _run(info, transport: str, seed: int, count_words: int = 0):
    if count_words:  # fewer per-expert counts per count round than local experts: a second round
        import deep_ep_npu.buffer_normal

        deep_ep_npu.buffer_normal.COUNT_WORDS = count_words
    r, me = info.world_size, info.rank
    buffer = Buffer(info.group, backend="reference", transport=transport, explicitly_destroy=True)
    all_x, all_idx, all_w = _all(r, seed)
    x, idx, w = all_x[me], all_idx[me], all_w[me]
    per_rank, per_expert, in_rank = oracle.layout(idx, E, r)
    got_layout = buffer.get_dispatch_layout(idx, E)
    assert torch.equal(got_layout[0], per_rank) and torch.equal(got_layout[2], per_expert)
    assert got_layout[1] is None and torch.equal(got_layout[3], in_rank)
    src, want_x, want_idx, want_w = oracle.received(me, all_x, all_idx, all_w, E, r)
    rows_of = [oracle.received(q, all_x, all_idx, all_w, E, r)[:2] for q in range(r)]
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    bias = (torch.ones((x.shape[0], H), dtype=torch.bfloat16), torch.randn((x.shape[0], H)).to(torch.bfloat16))
    for fp8 in (False, True):
        cur, want_cur = (_fp8(x), _fp8(want_x)) if fp8 else (x, want_x)
        for async_finish in (False, True):
            for with_topk in (False, True):
                kw = dict(layout, config=Config(24, 8, 256), async_finish=async_finish)
                if with_topk:
                    kw.update(topk_idx=idx.to(torch.int32), topk_weights=w, expert_alignment=4)
                recv_x, recv_idx, recv_w, listed, handle, event = buffer.dispatch(cur, **kw)
                event.current_stream_wait()
                _check_rows(recv_x, want_cur, fp8)
                assert (
                    handle[0][:, me].tolist()
                    == torch.tensor([sum(p == q for p, _ in src) for q in range(r)]).cumsum(0).tolist()
                )
                assert handle[3].tolist() == [t for _, t in src] and torch.equal(handle[4], in_rank)
                if with_topk:
                    assert recv_idx.dtype == torch.int32 and torch.equal(recv_idx.long(), want_idx)
                    assert torch.equal(recv_w, want_w)
                    assert listed == oracle.recv_list(me, all_idx, E, r, 4)
                    worst = buffer.dispatch(cur, **kw, num_worst_tokens=sum(_tokens(p) for p in range(r)))
                    worst[5].current_stream_wait()
                    n = want_x.shape[0]
                    head = (worst[0][0][:n], worst[0][1][:n]) if fp8 else worst[0][:n]
                    _check_rows(head, want_cur, fp8)
                    assert worst[3] == [] and torch.equal(worst[2][:n], want_w) and bool((worst[1][n:] == -1).all())
                else:
                    assert recv_idx is None and recv_w is None and listed == oracle.recv_list(me, all_idx, E, r, 1)
                    cached = buffer.dispatch(cur, handle=handle, async_finish=async_finish)
                    cached[5].current_stream_wait()
                    _check_rows(cached[0], want_cur, fp8)
                    assert cached[1:5] == (None, None, None, None)
                y = (want_x.float() * (me + 1)).to(torch.bfloat16)  # the "experts": rank q scales by q + 1
                ys = [(s, (yx.float() * (q + 1)).to(torch.bfloat16)) for q, (s, yx) in enumerate(rows_of)]
                for b in ((), bias[:1], bias):
                    out, out_w, event = buffer.combine(
                        y,
                        handle,
                        topk_weights=recv_w,
                        bias=b[0] if len(b) == 1 else (b or None),
                        async_finish=async_finish,
                    )
                    event.current_stream_wait()
                    assert torch.equal(out, oracle.combined(me, x.shape[0], ys, b, torch.bfloat16))
                    if with_topk:
                        assert torch.equal(out_w, w.masked_fill(idx < 0, 0.0))
                    else:
                        assert out_w is None
    buffer.destroy()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_normal_mode_matches_oracle(world_size):
    assert all(parallel_launch(world_size, _run, "auto", 1, timeout=240))


def test_normal_mode_collective_transport():
    assert all(parallel_launch(2, _run, "collective", 2, 2, timeout=240))


def _bad(info, case: str):
    buffer = Buffer(info.group, backend="reference")
    r, me = info.world_size, info.rank
    x, idx, w = oracle.inputs(me, 4, H, K, E, 3)
    per_rank, per_expert, in_rank = oracle.layout(idx, E, r)
    kw = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )
    bad = me == 1
    if case == "in_rank" and bad:
        kw["is_token_in_rank"] = ~in_rank
        kw["num_tokens_per_rank"] = (~in_rank).sum(dim=0).to(torch.int32)  # consistent, but not topk_idx's
    elif case == "per_rank" and bad:
        kw["num_tokens_per_rank"] = per_rank + 1
    elif case == "per_expert" and bad:
        kw["num_tokens_per_expert"] = torch.zeros(E, dtype=torch.int32)
    elif case == "experts_differ" and bad:
        kw["num_tokens_per_expert"] = torch.zeros(2 * E, dtype=torch.int32)
        kw.pop("topk_idx"), kw.pop("topk_weights")
    elif case == "weights_only" and bad:
        kw.pop("topk_idx")
    elif case == "x_dtype" and bad:
        kw["x"] = x.to(torch.int32)
    elif case == "worst" and bad:
        kw["num_worst_tokens"] = 1
    elif case == "comm_stream" and bad:
        kw["allocate_on_comm_stream"] = True
    with pytest.raises(MoeDistributeError) as err:
        buffer.dispatch(**{"x": x, **kw})
    # the group is still in step: a good round works
    got = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    out, _, _ = buffer.combine(got[0], got[4])
    assert torch.equal(out, (x.float() * in_rank.sum(dim=1, keepdim=True)).to(torch.bfloat16))
    return str(err.value)


CASES = {
    "in_rank": "is_token_in_rank",
    "per_rank": "num_tokens_per_rank",
    "per_expert": "num_tokens_per_expert",
    "experts_differ": "num_tokens_per_expert",
    "weights_only": "topk_idx",
    "x_dtype": "x",
    "worst": "num_worst_tokens",
    "comm_stream": "allocate_on_comm_stream",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_normal_mode_errors_every_rank(case):
    messages = parallel_launch(2, _bad, case, timeout=120)
    param = CASES[case]
    if case == "worst":  # found by the count round: the same message on every rank
        assert all("num_worst_tokens: dispatch: rank 1 receives" in m for m in messages), messages
    elif case == "experts_differ":
        assert all(f"] {param}: dispatch: ranks disagree on the number of experts" in m for m in messages), messages
    else:
        assert f"] {param}:" in messages[1], messages
        assert "dispatch aborted on every rank: rejected on rank 1" in messages[0], messages


def _ascend(info):
    from deep_ep_npu import sim

    sim.install()
    r, me = info.world_size, info.rank
    x, idx, w = oracle.inputs(me, _tokens(me), H, K, E, 5)
    per_rank, per_expert, in_rank = oracle.layout(idx, E, r)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    got = []
    for backend in ("reference", "ascend"):  # the Ascend backend's code on the stand-in's ops
        buffer = Buffer(info.group, backend=backend)
        d = buffer.dispatch(x, **layout, topk_idx=idx, topk_weights=w)
        combined = buffer.combine(d[0], d[4], bias=torch.ones_like(x))[0]
        plain = buffer.dispatch(x, **layout)
        got.append((*d[:3], d[3], combined, plain[0], buffer.combine(plain[0], plain[4])[0]))
    sim.uninstall()
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(*got, strict=True))


def test_normal_mode_on_the_npu_stand_in():
    """The ascend backend (its ``expand`` path on the ops) equals the reference bit for bit in normal mode (bf16;
    combine's ``topk_weights`` and a second bias have no Ascend op and raise there, naming the parameter)."""
    assert all(parallel_launch(2, _ascend, timeout=120))
