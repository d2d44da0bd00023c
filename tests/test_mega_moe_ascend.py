"""Contract tests of the ``ascend`` MegaMoE backend: the mapping onto ``torch.ops._C_ascend.dispatch_ffn_combine``,
when the fused op may be used, and the backend registry. The op itself needs an NPU (parity: ``npu`` marker)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deep_ep_npu.mega_moe import AscendMegaMoe, available_backends, create_backend
from deep_ep_npu.mega_moe.ascend import fused_op_blocker, fused_op_kwargs
from deep_ep_npu.mega_moe.params import MegaMoeArgs

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def _args(*, int8=True, hidden=256, n=128, x_dtype=torch.bfloat16, out_dtype=torch.float16, idx=None) -> MegaMoeArgs:
    g = torch.Generator().manual_seed(0)
    m, topk, num_local, w = 6, 2, 4, 2
    if idx is None:
        idx = torch.stack([torch.randperm(num_local * w, generator=g)[:topk] for _ in range(m)])
    wdt = torch.int8 if int8 else torch.bfloat16
    return MegaMoeArgs(
        group=None,  # type: ignore[arg-type]
        world_size=w,
        rank=1,
        x=torch.randn((m, hidden), generator=g).to(x_dtype),
        topk_idx=idx.long(),
        topk_weights=torch.rand((m, topk), generator=g),
        w1=torch.zeros((num_local, hidden, 2 * n), dtype=wdt),
        w2=torch.zeros((num_local, n, hidden), dtype=wdt),
        w1_scale=torch.rand((num_local, 2 * n)) if int8 else None,
        w2_scale=torch.rand((num_local, hidden)) if int8 else None,
        num_max_dispatch_tokens_per_rank=8,
        num_experts=num_local * w,
        out_dtype=out_dtype,
        max_output_size=32,
        num_segments=2,
        segment_by="expert",
    )


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_fused_op_kwargs_mapping(int8):
    args = _args(int8=int8)
    marked = []
    kw = fused_op_kwargs(args, "hccl_comm_7", lambda w: marked.append(w) or w.clone())
    assert set(kw) == {
        "x", "weight1", "weight2", "expert_idx", "scale1", "scale2", "bias1", "bias2", "probs", "group",
        "max_output_size", "out", "expert_token_nums",
    }  # fmt: skip
    assert kw["x"] is args.x and kw["probs"] is args.topk_weights and kw["group"] == "hccl_comm_7"
    assert kw["expert_idx"].dtype == torch.int32 and torch.equal(kw["expert_idx"].long(), args.topk_idx)
    assert [t.shape for t in kw["weight1"]] == [args.w1.shape] and [t.shape for t in kw["weight2"]] == [args.w2.shape]
    assert len(marked) == 2 and marked[0] is args.w1 and marked[1] is args.w2  # both weights go through NZ casting
    if int8:
        assert kw["scale1"][0] is args.w1_scale and kw["scale2"][0] is args.w2_scale
    else:
        assert all(s[0].numel() == 0 and s[0].dtype == torch.int64 for s in (kw["scale1"], kw["scale2"]))
    assert all(b[0].numel() == 0 and b[0].dtype == torch.float32 for b in (kw["bias1"], kw["bias2"]))
    assert kw["max_output_size"] == 32
    assert kw["out"].shape == (6, 256) and kw["out"].dtype == torch.bfloat16
    assert kw["expert_token_nums"].shape == (4,) and kw["expert_token_nums"].dtype == torch.int32


def test_fused_op_eligibility():
    assert fused_op_blocker(_args()) is None
    assert fused_op_blocker(_args(int8=False)) is None
    assert "bfloat16" in fused_op_blocker(_args(x_dtype=torch.float32))
    assert "128" in fused_op_blocker(_args(hidden=192))
    assert "64" in fused_op_blocker(_args(n=96))
    holes = torch.tensor([[0, -1]] * 6)
    assert "-1" in fused_op_blocker(_args(idx=holes))


def test_ascend_backend_calls_fused_op_and_casts_out():
    calls = []

    def fake_op(**kw):
        calls.append(kw)
        kw["out"].fill_(1.5)
        kw["expert_token_nums"].fill_(3)

    backend = AscendMegaMoe(
        fused_op=fake_op, group_name=lambda g, r: f"comm{r}", prepare_weight=lambda w: w, device_type="cpu"
    )
    args = _args()
    assert backend.can_fuse(args)
    out = backend.run(args, fused=True)
    assert len(calls) == 1 and calls[0]["group"] == "comm1"
    assert out.dtype == torch.float16 and out.shape == (6, 256) and bool((out == 1.5).all())
    assert not backend.can_fuse(_args(hidden=192))  # ineligible calls fall back to the reference pipeline
    on_npu_only = AscendMegaMoe(fused_op=fake_op, group_name=lambda g, r: "", prepare_weight=lambda w: w)
    assert not on_npu_only.can_fuse(args)  # x on the CPU: the fused op is not used


def test_backend_registry():
    assert available_backends() == ["ascend", "auto", "reference"]
    assert create_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="available"):
        create_backend("cuda")
    if not HAS_TORCH_NPU:
        assert create_backend("auto").name == "reference"
        with pytest.raises(ImportError, match="npu"):
            create_backend("ascend")


@pytest.mark.npu
@pytest.mark.skipif(not HAS_TORCH_NPU, reason="needs torch_npu and an Ascend NPU")
def test_ascend_backend_resolves_fused_op():
    backend = create_backend("ascend")
    assert backend.name == "ascend"  # fused_op is None when vllm-ascend's custom ops are not loaded
