"""The ``ascend`` MegaMoE backend and the fused op ``torch.ops._C_ascend.dispatch_ffn_combine``.

With ``deep_ep_npu.sim`` installed, ``mega_moe(..., backend="ascend")`` runs its real fused mapping (Fixpipe scale
words, NZ casts, the comm name) into the stand-in op (``deep_ep_npu.sim.fused``, our engine on CPU), at W = 2 and
W = 4 over gloo: it must equal the reference backend bit for bit and the independent oracle
(``tests/support/mega_moe_oracle.py``) within the documented tolerance, for int8 and bf16 weights, with an active-token
mask whose masked rows hold garbage and a clamping swiglu_limit. The op is also called directly as vllm-ascend calls it
(per-expert weight lists, int64 scales, a `[1, E_local]` expert_token_nums, a non-prefix mask). NPU parity: ``npu``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deep_ep_npu.backends import available_backends, create_backend, resolve_backend_name
from deep_ep_npu.backends.ascend import AscendBackend
from deep_ep_npu.backends.ascend_mega import (
    fixpipe_scale,
    fixpipe_scale_value,
    fused_mega_moe,
    fused_op_blocker,
    fused_op_kwargs,
)
from deep_ep_npu.core.call import FFN, Experts, FusedCall
from deep_ep_npu.sim import fused
from tests.support.distributed import parallel_launch
from tests.support.mega_moe_oracle import Case, assert_matches, dense_reference, make_case
from tests.support.mega_moe_run import run_fused

HAS_REAL_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None and not getattr(
    sys.modules.get("torch_npu"), "SIMULATED", False
)


def _no_torch_npu() -> bool:
    """Neither torch_npu nor the stand-in is importable now (another test may have installed the stand-in here)."""
    return importlib.util.find_spec("torch_npu") is None


def _args(
    *, int8=True, hidden=256, n=128, x_dtype=torch.bfloat16, out_dtype=torch.bfloat16, idx=None, mask=None, limit=0.0
) -> tuple[FusedCall, FFN]:
    """A validated fused call of rank 1 of 2 (E_local 4, M 6, topK 2) and its FFN."""
    g = torch.Generator().manual_seed(0)
    m, topk, num_local, w = 6, 2, 4, 2
    if idx is None:
        idx = torch.stack([torch.randperm(num_local * w, generator=g)[:topk] for _ in range(m)])
    wdt = torch.int8 if int8 else x_dtype
    experts = Experts(w, 1, num_local * w, num_local, num_local, w, 1, (0, 1), scales_experts=num_local * w)
    x, weights = torch.randn((m, hidden), generator=g).to(x_dtype), torch.rand((m, topk), generator=g)
    ids = idx.long()
    call = FusedCall("mega_moe", x, ids, experts, num_max=8, x_active_mask=mask, expert_scales=weights)
    ffn = FFN(
        torch.zeros((num_local, hidden, 2 * n), dtype=wdt),
        torch.zeros((num_local, n, hidden), dtype=wdt),
        torch.rand((num_local, 2 * n)) if int8 else None,
        torch.rand((num_local, hidden)) if int8 else None,
        out_dtype,
        limit,
        2,
        "expert",
        32,
    )
    return call, ffn


def test_fixpipe_scale_words():
    """fp32 -> int64 Fixpipe words is vllm-ascend's conversion (fp32 bytes read as int32, widened) and inverts
    exactly, negative, subnormal and huge scales included."""
    s = torch.tensor([[0.5, -3.25e-5, 1.1e-40, 3.0e38], [1.0, 7.0, -0.0, 2.0**-126]], dtype=torch.float32)
    words = fixpipe_scale(s)
    want = np.frombuffer(s.numpy().tobytes(), dtype=np.int32).astype(np.int64).reshape(2, 4)
    assert words.dtype == torch.int64 and words.shape == s.shape and np.array_equal(words.numpy(), want)
    back = fixpipe_scale_value(words)
    assert back.dtype == torch.float32 and torch.equal(back.view(torch.int32), s.view(torch.int32))
    assert torch.equal(fixpipe_scale_value(words & 0xFFFFFFFF), s)  # unsigned (zero-extended) words read the same


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_fused_op_kwargs_mapping(int8):
    mask = torch.tensor([True] * 4 + [False] * 2)
    idx = torch.tensor([[0, 1]] * 4 + [[-1, -1]] * 2)  # masked rows carry -1 after validation
    call, ffn = _args(int8=int8, idx=idx, mask=mask, limit=7.0 if int8 else 0.0)
    marked = []
    kw = fused_op_kwargs(call, ffn, "hccl_comm_7", lambda w: marked.append(w) or w.clone())
    assert set(kw) == {
        "x",
        "weight1",
        "weight2",
        "expert_idx",
        "scale1",
        "scale2",
        "bias1",
        "bias2",
        "probs",
        "group",
        "max_output_size",
        "out",
        "expert_token_nums",
        "x_active_mask",
        "swiglu_limit",
    }
    assert kw["x"] is call.x and kw["group"] == "hccl_comm_7"
    assert torch.equal(kw["probs"], call.expert_scales.masked_fill(idx < 0, 0.0))  # (-1: weight 0)
    routed = torch.tensor([[0, 1]] * 6)  # a -1 goes to an expert its row does not list (masked rows: any)
    assert kw["expert_idx"].dtype == torch.int32 and torch.equal(kw["expert_idx"].long(), routed)
    assert [t.shape for t in kw["weight1"]] == [ffn.w1.shape] and [t.shape for t in kw["weight2"]] == [ffn.w2.shape]
    assert len(marked) == 2 and marked[0] is ffn.w1 and marked[1] is ffn.w2  # both weights go through NZ casting
    if int8:
        assert kw["scale1"][0].dtype == kw["scale2"][0].dtype == torch.int64
        assert torch.equal(fixpipe_scale_value(kw["scale1"][0]), ffn.w1_scale)
        assert torch.equal(fixpipe_scale_value(kw["scale2"][0]), ffn.w2_scale)
    else:
        assert all(s[0].numel() == 0 and s[0].dtype == torch.int64 for s in (kw["scale1"], kw["scale2"]))
    assert all(b[0].numel() == 0 and b[0].dtype == torch.float32 for b in (kw["bias1"], kw["bias2"]))
    assert kw["max_output_size"] == 32 and kw["x_active_mask"] is mask and kw["swiglu_limit"] == ffn.swiglu_limit
    assert kw["out"].shape == (6, 256) and kw["out"].dtype == torch.bfloat16
    assert kw["expert_token_nums"].shape == (4,) and kw["expert_token_nums"].dtype == torch.int32


def test_fused_op_eligibility():
    mask = torch.tensor([True] * 4 + [False] * 2)
    masked_idx = torch.tensor([[0, 1]] * 4 + [[-1, -1]] * 2)
    assert fused_op_blocker(*_args()) is None
    assert fused_op_blocker(*_args(int8=False)) is None
    assert fused_op_blocker(*_args(x_dtype=torch.float16, out_dtype=torch.float16)) is None
    assert fused_op_blocker(*_args(idx=masked_idx, mask=mask, limit=7.0)) is None  # int8: mask and clamp are fused
    assert "bfloat16" in fused_op_blocker(*_args(x_dtype=torch.float32, out_dtype=torch.float32))
    assert "out_dtype" in fused_op_blocker(*_args(out_dtype=torch.float16))
    assert "128" in fused_op_blocker(*_args(hidden=192))
    assert "64" in fused_op_blocker(*_args(n=96))
    no_expert = _args(idx=torch.tensor([[0, -1], [-1, 3], [-1, -1]] * 2))  # -1: another expert, weight 0
    assert fused_op_blocker(*no_expert) is None
    kw = fused_op_kwargs(*no_expert, "comm", lambda w: w)
    assert torch.equal(kw["expert_idx"].long(), torch.tensor([[0, 1], [0, 3], [0, 1]] * 2))
    assert torch.equal(kw["probs"], no_expert[0].expert_scales.masked_fill(no_expert[0].expert_ids < 0, 0.0))
    assert "ignores" in fused_op_blocker(*_args(int8=False, idx=masked_idx, mask=mask))
    assert "ignores" in fused_op_blocker(*_args(int8=False, limit=7.0))


def test_ascend_backend_calls_fused_op():
    calls = []

    def fake_op(**kw):
        calls.append(kw)
        kw["out"].fill_(1.5)
        kw["expert_token_nums"].fill_(3)

    ops = SimpleNamespace(
        fused_op=fake_op, group_name=lambda g, r: f"comm{r}", prepare_weight=lambda w: w, device_type="cpu"
    )
    backend = SimpleNamespace(ops=ops)
    call, ffn = _args()
    assert AscendBackend.can_fuse(backend, call, ffn)  # type: ignore[arg-type]
    out = fused_mega_moe(ops, None, 1, call, ffn)
    assert len(calls) == 1 and calls[0]["group"] == "comm1"
    assert out.dtype == torch.bfloat16 and out.shape == (6, 256) and bool((out == 1.5).all())
    assert not AscendBackend.can_fuse(backend, *_args(hidden=192))  # ineligible calls run the reference pipeline
    on_npu = SimpleNamespace(ops=SimpleNamespace(fused_op=fake_op, device_type="npu"))
    assert not AscendBackend.can_fuse(on_npu, call, ffn)  # x on the CPU: not fused
    assert not AscendBackend.can_fuse(SimpleNamespace(ops=SimpleNamespace(fused_op=None, device_type="cpu")), call, ffn)


def test_backend_registry():
    assert available_backends() == ["ascend", "reference"]
    with pytest.raises(ValueError, match="known backends"):
        resolve_backend_name("cuda")
    if _no_torch_npu():
        assert resolve_backend_name("auto") == "reference"
        with pytest.raises(ImportError, match="npu"):
            create_backend("ascend", None)  # type: ignore[arg-type]


def test_register_unregister_register():
    """The stand-in op has vllm-ascend's schema (names, order, defaults; alias-annotated outputs); unregister
    removes it and a second register works."""
    was = fused.registered()
    fused.unregister()
    try:
        assert not hasattr(torch.ops._C_ascend, "dispatch_ffn_combine")
        for _ in range(2):
            fused.register()
            fused.register()  # idempotent
            schema = str(torch.ops._C_ascend.dispatch_ffn_combine.default._schema)
            assert schema.startswith("_C_ascend::dispatch_ffn_combine(Tensor x, Tensor[] weight1, Tensor[] weight2, ")
            tail = (
                "int max_output_size, Tensor(a!) out, Tensor(b!) expert_token_nums, Tensor? x_active_mask=None, "
                "float swiglu_limit=1000000.) -> (Tensor(a!) out, Tensor(b!) expert_token_nums)"
            )
            assert schema.endswith(tail), schema
            fused.unregister()
            assert not hasattr(torch.ops._C_ascend, "dispatch_ffn_combine")
    finally:
        if was:
            fused.register()


# ---------------------------------------------------------------- the real mapping on the stand-in


def _fused_vs_reference(info, case: Case):
    """Under deep_ep_npu.sim: whether every rank agreed to fuse, the ascend backend's result (the stand-in op),
    the reference backend's, and Buffer(backend="ascend").mega_moe's."""
    from deep_ep_npu import sim
    from deep_ep_npu.mega_moe import prepare

    sim.install()
    x, idx, p, w1, w2, s1, s2 = case.rank_args(info.rank)
    backend = create_backend("ascend", info.group)
    ffn = FFN(w1, w2, s1, s2, swiglu_limit=case.swiglu_limit)
    num_experts = case.num_local * info.world_size
    _, _, fused_ok = prepare(backend, x, idx, p, ffn, case.num_max, num_experts, case.mask(info.rank))
    ascend = run_fused(info, case, dict(backend="ascend"))
    reference = run_fused(info, case, dict(backend="reference"))
    buffer = run_fused(info, case, dict(via_buffer=True, backend="ascend"))
    return fused_ok, ascend, reference, buffer


@pytest.mark.parametrize(
    ("world", "int8"), [(2, True), (2, False), (4, True), (4, False)], ids=["w2-int8", "w2-bf16", "w4-int8", "w4-bf16"]
)
def test_sim_fused_equals_reference_and_oracle(world, int8):
    """int8: a mask with garbage rows and a clamping limit go to the fused op; bf16 weights: fused without them (the
    BF16 kernel ignores both), and with them the backend falls back to the reference pipeline."""
    tokens = [6, 0, 5, 8][:world]
    inactive = [2, 0, 5, 1][:world] if int8 else None
    case = make_case(20 + world, tokens, 128, 64, 3, 2, int8=int8, inactive=inactive, swiglu_limit=0.5 if int8 else 0)
    cases = [case] if int8 else [case, dataclasses.replace(case, swiglu_limit=0.75)]
    for c in cases:
        ref = dense_reference(c, torch.bfloat16)
        for r, (fused_ok, ascend, reference, buffer) in enumerate(
            parallel_launch(world, _fused_vs_reference, c, timeout=90)
        ):
            assert fused_ok == (c is case), (r, fused_ok)
            assert torch.equal(ascend, reference) and torch.equal(buffer, reference)
            assert_matches(ascend, ref[r], int8)
            if c.active is not None:
                assert bool((ascend[c.active[r] :] == 0).all())


def _call_op(info, case: Case, mask_pattern: list[bool] | None, bad_rank: int | None):
    """The stand-in op called as vllm-ascend's test calls it: per-expert weight and scale lists, int64 scales,
    ``bias=[empty]``, expert_token_nums `[1, E_local]`; ``bad_rank`` passes an out-of-range id."""
    from deep_ep_npu import sim
    from deep_ep_npu.errors import MoeDistributeError

    sim.install()
    x, idx, p, w1, w2, s1, s2 = case.rank_args(info.rank)
    mask = None if mask_pattern is None else torch.tensor(mask_pattern[: x.shape[0]])
    if info.rank == bad_rank:
        idx = idx.clone()
        idx[0, 0] = case.num_local * info.world_size
    out = torch.full_like(x, 3.0)
    counts = torch.full((1, case.num_local), -1, dtype=torch.int32)
    try:
        res = torch.ops._C_ascend.dispatch_ffn_combine(
            x=x,
            weight1=list(w1),
            weight2=list(w2),
            expert_idx=idx,
            scale1=list(fixpipe_scale(s1)),
            scale2=list(fixpipe_scale(s2)),
            bias1=[torch.tensor([])],
            bias2=[torch.tensor([])],
            probs=p,
            group=sim.hccl_comm_name(info.group),
            max_output_size=512,
            out=out,
            expert_token_nums=counts,
            x_active_mask=mask,
            swiglu_limit=0.0,
        )
    except MoeDistributeError as err:
        return err.param, str(err)
    assert res[0] is out and res[1] is counts
    return out, counts


def test_sim_op_called_like_vllm_ascend():
    """A non-prefix mask (the op takes any; MegaMoE's API takes prefixes), list-form weights; expert_token_nums are
    the rows each local expert received (checked against the routing); a bad id on one rank raises on every rank."""
    case = make_case(31, [6, 5], 128, 64, 2, 2)
    pattern = [True, False, True, True, False, True]
    outs = parallel_launch(2, _call_op, case, pattern, None, timeout=60)
    actives = [torch.tensor(pattern[: x.shape[0]]) for x in case.xs]
    e = case.num_local * 2
    received = sum(
        torch.bincount(ids[a].long().flatten(), minlength=e) for ids, a in zip(case.idx, actives, strict=True)
    )
    ref = dense_reference(case, torch.bfloat16)  # every token, so the active ones can be compared
    for r, (out, counts) in enumerate(outs):
        assert bool((out[~actives[r]] == 0).all())
        assert_matches(out[actives[r]], ref[r][actives[r]], int8=True)
        assert counts.shape == (1, case.num_local) and torch.equal(counts.flatten().long(), received.view(2, -1)[r])
    errs = parallel_launch(2, _call_op, case, None, 1, timeout=60)
    assert errs[1][0] == "expert_idx" and "allowed" in errs[1][1]
    assert isinstance(errs[0], tuple) and "rank 1" in errs[0][1]


@pytest.mark.npu
@pytest.mark.skipif(not HAS_REAL_TORCH_NPU, reason="needs torch_npu and an Ascend NPU")
def test_ascend_backend_resolves_fused_op():
    def resolve(info):
        backend = create_backend("ascend", info.group)
        return backend.name, backend.ops.device_type  # fused_op is None when vllm-ascend's custom ops are not loaded

    assert parallel_launch(1, resolve, timeout=60) == [("ascend", "npu")]
