"""``kernels.rms_norm`` (RMSNorm of bf16 rows in one call) against the torch ops it replaces (transformers' RMSNorm:
Qwen3-MoE's weight after the bf16 rounding, gpt-oss' fp32 weight before it), and the model's RMSNorm on it."""

from __future__ import annotations

import pytest
import torch
from deep_ep_npu.kernels._cpu import rms_norm as raw_rms_norm

from deep_ep_npu import kernels
from deep_ep_npu.kernels.rms_norm import rms_norm
from server.models.layers import RMSNorm


def _torch(x: torch.Tensor, w: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    x32 = x.float()
    n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * n.to(torch.bfloat16) if round_first else (w * n).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 1024), (16, 64), (7, 1000), (2, 3, 5)])
@pytest.mark.parametrize(
    ("round_first", "w_dtype"), [(True, torch.bfloat16), (False, torch.float32), (False, torch.bfloat16)]
)
def test_rms_norm_is_the_torch_ops(shape: tuple[int, ...], round_first: bool, w_dtype: torch.dtype) -> None:
    """Equal to torch's ops but where the sum of squares' order moves a rounding: within one bf16 step of them, and
    equal in at least 99.9% of the elements (K tails, 3-D rows, large and tiny rows included)."""
    if kernels.library() is None:
        pytest.skip(kernels.unavailable())
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).bfloat16()
    w = torch.randn(shape[-1], generator=g).to(w_dtype)
    y = rms_norm(x, w, 1e-6, round_first=round_first)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = _torch(x, w, 1e-6, round_first)
    step = ref.float().abs().clamp(min=1e-30) * 2**-7  # one bf16 step at each value
    assert bool(((y.float() - ref.float()).abs() <= step).all())
    assert (y == ref).float().mean().item() >= 0.999


def test_rms_norm_applies_only_where_exact() -> None:
    """None (nothing done) for fp32 rows, non-contiguous rows, a shape mismatch, or an fp32 weight with
    ``round_first`` (torch would return fp32 there); the binding refuses that last one by name too."""
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(8).bfloat16()
    assert rms_norm(x.float(), w, 1e-6) is None
    assert rms_norm(x.t(), w[:4], 1e-6) is None
    assert rms_norm(x, w[:4], 1e-6) is None
    assert rms_norm(x, w.float(), 1e-6) is None
    if kernels.library() is None:
        pytest.skip(kernels.unavailable())
    with pytest.raises(ValueError, match="round_first takes a bf16 weight"):
        raw_rms_norm(x, 4, 8, w.float(), 1, 1, 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match="y holds 32 bytes"):
        raw_rms_norm(x, 4, 8, w, 0, 1, 1e-6, torch.empty(16).bfloat16())


@pytest.mark.parametrize("weight_fp32", [False, True])
def test_model_rms_norm_on_the_kernel_equals_its_torch_path(weight_fp32: bool) -> None:
    norm = RMSNorm(512, 1e-5, weight_fp32=weight_fp32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(512))
    norm = norm if weight_fp32 else norm.bfloat16()
    x = torch.randn(9, 512).bfloat16()
    y = norm(x)
    with kernels.disabled():
        ref = norm(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), atol=0, rtol=2**-7)
