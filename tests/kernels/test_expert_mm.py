"""``kernels.expert_mm`` (the bf16 expert matmul of the grouped layout) against an fp64 oracle, and the MoE block that
runs it against torch's grouped matmul."""

from __future__ import annotations

import pytest
import torch
from deep_ep_npu.kernels._cpu import expert_mm as raw_expert_mm

from deep_ep_npu import kernels
from deep_ep_npu.kernels.expert_mm import expert_mm


def _case(g: torch.Generator, counts: list[int], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    x = torch.randn(sum(counts) + 2, k, generator=g).bfloat16()  # + 2 padding rows past offsets[-1]
    return x, w, torch.tensor(counts).cumsum(0).to(torch.int32)


def _oracle(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    pairs = enumerate(zip([0, *ends[:-1]], ends, strict=True))
    return torch.cat([x[b:e].double() @ w[i].double().T for i, (b, e) in pairs])


def _ran(y: torch.Tensor | None) -> torch.Tensor:
    if y is None:
        pytest.skip(f"expert_mm does not run here ({kernels.unavailable() or 'no AVX512-BF16'})")
    return y


@pytest.mark.parametrize(
    "counts, n, k",
    [([1] * 8 + [0] * 8, 1024, 1024), ([2, 3, 0, 1], 96, 256), ([0, 5, 3], 7, 50), ([3, 0, 1, 2], 33, 130)]
    + [([0, 1], 4, 32)],
)
def test_expert_mm_is_the_exact_sum_rounded(counts: list[int], n: int, k: int) -> None:
    """Each output is the fp64 sum rounded to bf16 up to the fp32 sum's error (products are exact in fp32): within
    one bf16 ulp of the oracle, and equal to its rounding in nearly every element; K tails and empty experts
    included; the thread count changes no bit (the first case has weights for 4 threads: 4 MiB each)."""
    x, w, offsets = _case(torch.Generator().manual_seed(len(counts) * k), counts, n, k)
    y = _ran(expert_mm(x, w, offsets, threads=1))
    rows = int(offsets[-1])
    ref = _oracle(x, w, offsets)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp(min=2.0**-126)
    assert ((y[:rows].double() - ref).abs() <= ulp).all()
    assert (y[:rows] == ref.bfloat16()).double().mean() > 0.999
    for threads in (2, 3, 64):
        assert torch.equal(_ran(expert_mm(x, w, offsets, threads=threads))[:rows], y[:rows])


def test_expert_mm_keeps_nan_and_inf() -> None:
    x, w, offsets = _case(torch.Generator().manual_seed(1), [2, 1], 8, 64)
    x[0, 3], x[2, 5] = float("nan"), float("inf")
    w[1].abs_()
    y = _ran(expert_mm(x, w, offsets))
    assert y[0].isnan().all() and not y[1].isnan().any()
    assert (y[2] == float("inf")).all()


def test_expert_mm_declines_what_it_does_not_run() -> None:
    x, w, offsets = _case(torch.Generator().manual_seed(2), [1, 1], 8, 64)
    assert expert_mm(x.float(), w.float(), offsets) is None
    assert expert_mm(x, w.transpose(1, 2), offsets) is None  # not contiguous / wrong shape
    assert expert_mm(x, w, offsets.long()) is None
    with kernels.disabled():
        assert expert_mm(x, w, offsets) is None


def test_expert_mm_binding_checks_offsets_and_sizes() -> None:
    x, w, offsets = _case(torch.Generator().manual_seed(3), [1, 1], 8, 64)
    y = torch.empty(x.shape[0], 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"offs\[1\] = 9"):
        raw_expert_mm(x, x.shape[0], w, 2, 8, 64, y, torch.tensor([1, 9], dtype=torch.int32), 1, 8)
    with pytest.raises(ValueError, match="w holds"):
        raw_expert_mm(x, x.shape[0], w, 3, 8, 64, y, torch.tensor([1, 2, 2], dtype=torch.int32), 1, 8)


def test_moe_experts_on_the_kernel_equal_the_grouped_matmul() -> None:
    """The server's bf16 experts (decode shapes: the kernel) against the same weights through torch's grouped
    matmul: equal up to the bf16 rounding of the intermediate."""
    from server.models.config import ModelConfig
    from server.models.moe import LocalExperts

    sizes = dict(hidden_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=1)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=32, intermediate_size=64)
    cfg = ModelConfig.from_hf(dict(architectures=["Qwen3MoeForCausalLM"], **sizes, **heads))
    experts = LocalExperts(cfg, 8).bfloat16()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) * 0.1)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * 0.1)
    x = torch.randn(12, 128, generator=g).bfloat16()
    offsets = torch.tensor([1, 3, 3, 6, 7, 9, 10, 10], dtype=torch.int32)
    with torch.no_grad():
        fast = _ran(experts.kernel(x, offsets))
        slow = experts.grouped(x, offsets)
    assert torch.allclose(fast[:10].float(), slow[:10].float(), rtol=0.02, atol=0.01)
    assert experts.kernel(torch.randn(65, 128).bfloat16(), offsets) is None  # > 8 rows per expert: torch's


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_server_linear_on_the_kernel_matches_f_linear(rows: int) -> None:
    """The server's ``linear`` (decode's dense projections): bf16 with at most 8 rows on the kernel, more rows on
    torch's matmul; both within one bf16 ulp of the fp64 product; the kernel adds the bias after."""
    from server.models.linear import linear

    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, 160), (48, 160), (48,)))
    ref = x.double() @ w.double().T
    y = linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 48)
    assert ((y.double() - ref).abs() <= torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-6).all()
    if rows <= 8:  # (torch's matmul adds the bias before its one rounding)
        assert torch.equal(linear(x, w, b), y + b)


def test_expert_mm_helpers_serve_concurrent_calls_and_a_forked_child() -> None:
    """The kernel's kept helper threads: four Python threads calling at once (one uses the helpers, the others run
    alone) and a child forked after the helpers started (it has none and starts its own) give the 1-thread bits."""
    import os
    import threading

    g = torch.Generator().manual_seed(3)
    x, w, offsets = _case(g, [1] * 16, 1024, 1024)  # 32 MiB of weights: 4 threads' worth
    ref = _ran(expert_mm(x, w, offsets, threads=1))[: offsets[-1]]
    results: list[bool] = []

    def call() -> None:
        results.extend(torch.equal(expert_mm(x, w, offsets, threads=4)[: offsets[-1]], ref) for _ in range(20))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [True] * 80
    pid = os.fork()
    if pid == 0:  # the child: no helper threads survive the fork; it leaves here whatever happens
        code = 3
        try:
            code = 0 if torch.equal(expert_mm(x, w, offsets, threads=4)[: offsets[-1]], ref) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_expert_mm_leaves_experts_past_max_rows() -> None:
    """``max_rows`` skips the experts with more rows (their output rows untouched), the others bit for bit as
    without it."""
    x, w, offsets = _case(torch.Generator().manual_seed(2), [3, 9, 0, 2, 12], 40, 64)
    full = _ran(expert_mm(x, w, offsets, threads=1))
    part = _ran(expert_mm(x, w, offsets, threads=1, max_rows=8))
    ends = offsets.tolist()
    for e, (begin, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if 0 < end - begin <= 8:
            assert torch.equal(part[begin:end], full[begin:end]), e


def test_local_experts_split_heavy_experts_to_torch_matmul() -> None:
    """Experts with more than MATMUL_ROWS rows run as torch's bf16 matmul, the rest on the kernel: each expert's rows
    equal its own FFN's (torch matmuls) within bf16 rounding."""
    from server.models import ModelConfig
    from server.models.moe import LocalExperts, swiglu
    from server.random_model import random_hf_config

    cfg = ModelConfig.from_hf(
        random_hf_config(
            {"architecture": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 4}
        )
    )
    experts = LocalExperts(cfg, 4).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) / 8)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) / 8)
    counts = [2, 11, 0, 3]  # expert 1 is heavy (> MATMUL_ROWS = 8)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    x = torch.randn(sum(counts), 64, generator=g).bfloat16()
    with torch.inference_mode():
        out = experts.kernel(x, offsets)
    assert out is not None
    begin = 0
    for e, n in enumerate(counts):
        rows = x[begin : begin + n]
        h = rows @ experts.w13[e].t()
        want = swiglu(h[:, :32], h[:, 32:], cfg) @ experts.w2[e].t()
        torch.testing.assert_close(out[begin : begin + n].float(), want.float(), atol=2e-2, rtol=2e-2)
        begin += n
