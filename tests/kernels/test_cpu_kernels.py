"""The CPU kernels (:mod:`deep_ep_npu.kernels`) against the torch code they replace, bit for bit.

The Buffer-level comparison (dispatch / combine results with and without the kernels, fp8 scales and fp32 combine
included) is ``tests/transports/test_transport.py::test_transports_are_bit_identical``; here each loop is checked on
its own on random inputs, edge cases included. The build and the loading: ``test_build.py``; argument checks:
``test_bindings.py``.
"""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import errors, kernels
from deep_ep_npu.core import rules
from deep_ep_npu.engine.plan import plan_topk
from deep_ep_npu.quant import INT8_PER_TOKEN, deepep_fp8

pytestmark = pytest.mark.skipif(kernels.unavailable() == "DEEP_EP_NPU_CPU_KERNELS=0", reason="kernels turned off")


def _ids(g: torch.Generator, t: int, k: int, e: int) -> torch.Tensor:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    if t:
        ids[torch.rand(t, k, generator=g) < 0.2] = -1
    return ids


def test_plan_matches_the_torch_plan():
    g, fields = torch.Generator().manual_seed(0), ("token", "slot", "dest", "expert", "row_token", "row_of_pair")
    for trial in range(200):
        r, nl = (int(torch.randint(1, 5, (1,), generator=g)) for _ in range(2))
        t, k = int(torch.randint(0, 7, (1,), generator=g)), int(torch.randint(1, min(r * nl, 4) + 1, (1,), generator=g))
        ids = _ids(g, t, k, r * nl)
        ids = ids.int() if trial % 3 == 0 else ids
        me, mask = int(torch.randint(0, r, (1,), generator=g)), (torch.rand(r, generator=g) < 0.3).int()
        for per_pair in (False, True):
            kw = dict(num_local_experts=nl, num_ranks=r, rank=me, mask=mask, per_pair_rows=per_pair)
            fast = plan_topk(ids, **kw)
            with kernels.disabled():
                ref = plan_topk(ids, **kw)
            case = (trial, per_pair, ids.tolist(), me, mask.tolist())
            for f in fields:
                assert torch.equal(getattr(fast, f), getattr(ref, f)), (f, case)
            assert (fast.pairs_per_dest, fast.rows_per_dest) == (ref.pairs_per_dest, ref.rows_per_dest), case
            if not per_pair:  # the slot table the torch route builds from the plan
                table = torch.full((len(ref.row_token), k), -1, dtype=torch.int32)
                table[ref.row_of_pair, ref.slot] = ref.expert.int()
                assert torch.equal(fast.slot_expert, table), case
            else:
                assert fast.slot_expert is None


@pytest.mark.parametrize("no_expert", [True, False])
def test_id_check_agrees_with_the_torch_check(no_expert):
    g = torch.Generator().manual_seed(1)
    verdicts = set()
    for _ in range(300):
        t, k, e = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)), 6
        ids = torch.randint(-2, e + 1, (t, k), generator=g)
        fast = kernels.ids_ok(ids, -1 if no_expert else 0, e)
        try:
            with kernels.disabled():
                rules.expert_ids(ids, "topk_idx", e, t, 8, no_expert=no_expert)
            ok = True
        except errors.MoeDistributeError:
            ok = False
        assert fast == ok, ids.tolist()
        verdicts.add(ok)
        if not fast:  # with the kernels on, a bad input still gets the torch check's error
            with pytest.raises(errors.MoeDistributeError):
                rules.expert_ids(ids, "topk_idx", e, t, 8, no_expert=no_expert)
    assert verdicts == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("zero_first", [False, True])
def test_accumulate_matches_index_add(dtype, indexed, zero_first):
    g = torch.Generator().manual_seed(2)
    tokens, hidden, n = 12, 300, 40
    x = (torch.randn(64 if indexed else n, hidden, generator=g) * 100).to(dtype)
    x[:, :3] = -0.0  # a first product of -0.0 still sums to +0.0 from zeros
    index = torch.randint(0, 64, (n,), generator=g) if indexed else None
    token = torch.randint(0, tokens - 2, (n,), generator=g)  # the last two tokens get no pair
    weight = torch.rand(n, generator=g) * 3
    start = torch.randn(tokens, hidden, generator=g)
    got = start.clone()
    assert kernels.accumulate(got, x, index, token, weight, zero_first=zero_first)
    rows = x if index is None else x[index]
    want = (start.zero_() if zero_first else start).index_add_(0, token, rows.float().mul_(weight.unsqueeze(1)))
    assert torch.equal(got, want) and torch.equal(got.sign(), want.sign())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit (signed zeros too)
    with pytest.raises(IndexError):
        kernels.accumulate(got, x, index, token + tokens, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_rows_matches_the_slot_ordered_index_add(dtype):
    """The flat combine's sum: rows from several tensors (one indexed), pairs summed slot after slot."""
    g = torch.Generator().manual_seed(4)
    for trial in range(20):
        tokens, hidden, k = 9, 72, 4
        token, slot = (t.flatten() for t in torch.meshgrid(torch.arange(tokens), torch.arange(k), indexing="ij"))
        keep = torch.rand(token.numel(), generator=g) < 0.7
        token, slot = token[keep], slot[keep]
        perm = torch.randperm(token.numel(), generator=g)  # pairs in any order (the plan's)
        token, slot, n = token[perm], slot[perm], int(keep.sum())
        own = (torch.randn(30, hidden, generator=g) * 50).to(dtype)
        own[:, :2] = -0.0
        own_index = torch.randint(0, 30, (n // 2,), generator=g)
        parts = [(torch.randn(m, hidden, generator=g) * 50).to(dtype) for m in (n // 4, n - n // 2 - n // 4)]
        y = torch.cat([own[own_index], *parts]).float()  # pair p's row: y[at[p]]
        at, weight = torch.randperm(n, generator=g), torch.rand(n, generator=g) * 2
        weight[:2] = 0.0
        got = torch.randn(tokens, hidden, generator=g)  # overwritten: the sum starts from zeros
        order = torch.argsort(slot, stable=True)
        rows = [(own, own_index), (own, own_index[:0]), *((p, None) for p in parts)]  # (an empty index: no rows)
        assert kernels.accumulate_rows(got, rows, at[order], token[order], weight[order])
        want = torch.zeros(tokens, hidden)
        values = y[at] * weight.unsqueeze(1)
        for j in range(k):
            sel = (slot == j).nonzero(as_tuple=True)[0]
            want.index_add_(0, token[sel], values[sel])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), trial  # bit for bit, signed zeros too
    with pytest.raises(IndexError):
        kernels.accumulate_rows(got, rows, at[order] + n, token[order], weight[order])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_tokens_matches_accumulate_rows_and_the_cast(dtype, out_dtype):
    """Normal-mode combine's sum straight into the output: the pairs by token (slots ascending), each token's sum
    rounded once to out's dtype, bit for bit as accumulate_rows into fp32 and torch's cast (NaN, zeros, no pairs)."""
    g = torch.Generator().manual_seed(6)
    for trial in range(12):
        tokens, hidden, k = 11, (72, 1100)[trial % 2], 3  # (the kernel sums 512 channels at a time)
        token, slot = (t.flatten() for t in torch.meshgrid(torch.arange(tokens), torch.arange(k), indexing="ij"))
        keep = torch.rand(token.numel(), generator=g) < 0.6
        token, slot, n = token[keep], slot[keep], int(keep.sum())
        own = (torch.randn(20, hidden, generator=g) * 50).to(dtype)
        own[:, :2], own[0, 5], own[1, 6] = -0.0, float("nan"), float("inf")
        own_index = torch.randint(0, 20, (n // 2,), generator=g)
        part = (torch.randn(n - n // 2, hidden, generator=g) * 50).to(dtype)
        at, weight = torch.randperm(n, generator=g), torch.rand(n, generator=g) * 2
        rows = [(own, own_index), (part, None)]
        by_slot = torch.argsort(slot, stable=True)
        acc = torch.empty(tokens, hidden)
        assert kernels.accumulate_rows(acc, rows, at[by_slot], token[by_slot], weight[by_slot])
        want = acc.to(out_dtype)
        order = by_slot[torch.argsort(token[by_slot], stable=True)]
        got = torch.full((tokens, hidden), 7.0, dtype=out_dtype)  # overwritten, rows of tokens without pairs too
        assert kernels.sum_tokens(got, rows, at[order], token[order], weight[order])
        bits = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), want.view(bits)), trial
    with pytest.raises(IndexError, match="out of order"):
        kernels.sum_tokens(got, rows, at[by_slot], token[by_slot], weight[by_slot])
    assert not kernels.sum_tokens(got.half(), rows, at[order], token[order], weight[order])  # fp16 out: torch code


@pytest.mark.parametrize("quant", [None, 2])
@pytest.mark.parametrize("weights", [False, True])
def test_place_flat_matches_the_torch_placement(quant, weights):
    """The flat layout's placement of two sources' rows (one of them this rank's) against Flat's torch code."""
    from types import SimpleNamespace

    from deep_ep_npu.engine.flat import _Flat
    from deep_ep_npu.engine.rows import RowFormat
    from deep_ep_npu.quant import Quant

    g = torch.Generator().manual_seed(5)
    hidden, k, num_local, world, cap = 64, 3, 4, 3, 60
    fmt = RowFormat(hidden, torch.bfloat16, None if quant is None else Quant(quant, torch.int8), k, weights)
    blocks = []
    for src, n in ((0, 7), (2, 5), (1, 6)):  # remote sources by rank, then this rank's own (rank 1)
        rows = torch.zeros((n, fmt.row_bytes), dtype=torch.uint8)
        table = torch.randint(-1, num_local, (n, k), generator=g, dtype=torch.int32)
        token, x = torch.randperm(9, generator=g)[:n], torch.randn(9, hidden, generator=g).bfloat16()
        fmt.encode_gathered(rows, x, token, table, torch.rand(n, k, generator=g) if weights else None)
        blocks.append((src, rows))
    scale_width = fmt.scale_end - fmt.scale_off
    outs = {}
    for name in ("kernel", "torch"):
        expand_x = torch.zeros((cap, hidden), dtype=fmt.data_dtype)
        scales = torch.zeros((cap, scale_width), dtype=torch.uint8)
        assist, expand_scales = torch.zeros(3 * cap, dtype=torch.int32), torch.zeros(cap)
        if name == "kernel":
            counts = torch.zeros((num_local, world), dtype=torch.int64)
            num = kernels.place_flat(blocks, fmt, scale_width, weights, counts, expand_x, scales, assist, expand_scales)
        else:
            counts = torch.zeros((num_local, world), dtype=torch.int64)
            flat = SimpleNamespace(
                fmt=fmt,
                c=SimpleNamespace(capacity=cap, quant=quant),
                source=expand_x,
                expand_x=expand_x,
                scale_bytes=scales,
                assist=assist,
                expand_scales=expand_scales,
                weights=torch.ones(1) if weights else None,
            )
            num = _Flat._place_torch(flat, blocks, counts)
        outs[name] = (num, counts, expand_x.view(torch.uint8), scales, assist, expand_scales)
    for a, b in zip(outs["kernel"], outs["torch"], strict=True):
        assert a == b if isinstance(a, int) else torch.equal(a, b)
    counts = torch.zeros((num_local, world), dtype=torch.int64)
    small = torch.zeros((4, hidden), dtype=fmt.data_dtype)
    assert (
        kernels.place_flat([blocks[2]], fmt, scale_width, weights, counts, small, scales[:4], assist, expand_scales)
        == -1
    )  # more pairs than rows: only the counts
    assert int(counts.sum()) == int((blocks[2][1][:, fmt.slot_off : fmt.weight_off].view(torch.int32) >= 0).sum())


@pytest.mark.parametrize("quant", ["fp8_e4m3", "int8_per_token"])
def test_place_scales_matches_the_torch_scatter(quant):
    """The masked layout's scales (`[L, cap, G]`, token dimension innermost) of placed pairs, as Masked's torch code
    writes them: fp8 rows carry one scale per 128 channels, int8 rows one, repeated over the groups."""
    from deep_ep_npu.engine.rows import RowFormat

    g = torch.Generator().manual_seed(8)
    hidden, num_local, cap, n = 256, 3, 10, 9
    fmt = RowFormat(hidden, torch.bfloat16, deepep_fp8() if quant == "fp8_e4m3" else INT8_PER_TOKEN, 2, False)
    rows = torch.randint(0, 256, (n, fmt.row_bytes), generator=g, dtype=torch.uint8)
    groups = hidden // 128
    k = 14
    pos = torch.randperm(num_local * cap, generator=g)[:k]
    row = torch.randint(0, n, (k,), generator=g)
    got = torch.zeros((num_local, groups, cap)).transpose(1, 2)
    want = torch.zeros((num_local, groups, cap)).transpose(1, 2)
    assert kernels.place_scales(rows, fmt.scale_off, row, pos, got, quant == "int8_per_token")
    s = fmt.scales(rows, row)
    want[pos // cap, pos % cap] = s if quant == "fp8_e4m3" else s.expand(-1, groups)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(IndexError):
        kernels.place_scales(rows, fmt.scale_off, row, pos + num_local * cap, got, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", [False, True])
def test_pack_int8_matches_the_torch_quantization(dtype, weights):
    """Per-token int8 rows (quant_mode 2): .5 ties, zero / Inf / -0.0 rows, bit for bit against the torch code; a NaN
    row is left to the torch code (which NaN its scale holds is torch's choice)."""
    from deep_ep_npu.engine.rows import RowFormat

    g = torch.Generator().manual_seed(6)
    t, hidden, k = 9, 40, 3
    x = torch.randn(t, hidden, generator=g) * 3
    x[0] = torch.tensor([127.0, *[(j % 7 - 3) + 0.5 for j in range(hidden - 1)]])  # scale 1: ties to even
    x[1], x[2, 5], x[3, 7], x[4] = 0.0, float("nan"), float("inf"), -0.0
    x = x.to(dtype)
    fmt = RowFormat(hidden, dtype, INT8_PER_TOKEN, k, weights)
    token = torch.tensor([0, 1, 3, 4, 5, 8, 0, 6])
    table = torch.randint(-1, 4, (token.numel(), k), generator=g, dtype=torch.int32)
    w = torch.rand(token.numel(), k, generator=g) if weights else None
    got = torch.zeros((token.numel(), fmt.row_bytes), dtype=torch.uint8)
    want = torch.zeros_like(got)
    assert kernels.pack_int8(x, token, table, w, got, fmt)
    with kernels.disabled():  # (the torch code)
        fmt.encode_gathered(want, x, token, table, w)
    assert torch.equal(got, want)
    assert not kernels.pack_int8(x, torch.tensor([0, 2]), table[:2], None if w is None else w[:2], got[:2], fmt)
    with pytest.raises(IndexError):
        kernels.pack_int8(x, token + t, table, w, got, fmt)


def test_e4m3_cast_matches_torch():
    """Every bf16 and fp16 value as fp32, the e4m3 rounding midpoints and their neighbours, specials."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.sort(finite[torch.isfinite(finite)].unique()).values
    mid = (grid[1:] + grid[:-1]) / 2
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 1e30, 448.0, 464.0, 480.0])
    near = [torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), torch.randn(100_000) * 1e-3]
    x = torch.cat([every.view(torch.bfloat16).float(), every.view(torch.float16).float(), mid, specials, *near])
    got = kernels.to_e4m3(x.contiguous())
    assert got is not None and torch.equal(got, x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_fp8_matches_the_torch_quantization(dtype):
    """DeepEP fp8 rows (per 128 channels): tiny (scale floor), zero and -0.0 groups, against the torch code; NaN / Inf
    groups are left to the torch code (which NaN bits come out is torch's choice)."""
    from deep_ep_npu.engine.rows import RowFormat

    g = torch.Generator().manual_seed(7)
    t, hidden, k = 7, 384, 2
    x = torch.randn(t, hidden, generator=g) * torch.tensor([1e-6, 1.0, 300.0]).repeat_interleave(128)
    x[1], x[5, :128] = 0.0, -0.0
    x[2, 3], x[3, 200], x[4, 300] = float("nan"), float("inf"), -float("inf")
    x = x.to(dtype)
    fmt = RowFormat(hidden, dtype, deepep_fp8(), k, False)
    token = torch.tensor([0, 1, 5, 6, 0])
    table = torch.randint(-1, 4, (token.numel(), k), generator=g, dtype=torch.int32)
    got = torch.zeros((token.numel(), fmt.row_bytes), dtype=torch.uint8)
    want = torch.zeros_like(got)
    assert kernels.pack_fp8(x, token, table, got, fmt)
    with kernels.disabled():  # (the torch code)
        fmt.encode_gathered(want, x, token, table, None)
    assert torch.equal(got, want)
    for bad in (2, 3, 4):
        assert not kernels.pack_fp8(x, torch.tensor([0, bad]), table[:2], got[:2], fmt)


def test_gather_matches_index_select():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 136, generator=g).to(torch.bfloat16)  # 272-byte rows: not a multiple of 64
    for width in (136, 128):
        src = x[:, :width].contiguous()
        index = torch.randint(0, 50, (31,), generator=g)
        out = torch.empty(31, width, dtype=torch.bfloat16)
        assert kernels.gather(src, index, out)
        assert torch.equal(out, src[index])
        wide = torch.zeros(31, width + 24, dtype=torch.bfloat16)  # the first columns of wider rows (a wire row)
        assert kernels.gather(src, index, wide[:, :width])
        assert torch.equal(wide[:, :width], src[index]) and not wide[:, width:].any()
        assert kernels.gather(x[:, :width], index, out)  # from the first columns of wider rows (a window's)
        assert torch.equal(out, src[index])
