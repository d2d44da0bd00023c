"""What engines touch on the stand-in besides the MoE distribute ops: ``torch.npu`` (streams, events, device calls),
torch_npu's local routing ops (``npu_moe_init_routing_v2`` and vllm-ascend's ``_C_ascend.npu_moe_init_routing_custom``,
``npu_moe_token_permute`` / ``unpermute``) against loop
oracles written here from torch_npu's documented semantics, and CANN's ``torch.ops.cann_ops_transformer.npu_mega_moe``
equal bit for bit to ``cann_ops_transformer.mega_moe`` on the same inputs."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import sim
from tests.support.distributed import parallel_launch


@pytest.fixture
def npu():
    module = sim.install()
    try:
        yield module
    finally:
        sim.uninstall()


def test_torch_npu_device_stand_in(npu):
    assert torch.npu is npu.npu and not torch.npu.is_available() and torch.npu.device_count() == 0
    assert torch.npu.synchronize() is None
    # engines place tensors on the current device (vllm-ascend's All2AllV dispatcher): the stand-in's NPU is the CPU
    assert torch.tensor([1], device=torch.npu.current_device()).device == torch.device("cpu")
    s = torch.npu.Stream()
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    with torch.npu.stream(s):
        assert torch.npu.current_stream() is s
        s.wait_stream(torch.npu.default_stream())
        end.record(s)
    assert torch.npu.current_stream() is torch.npu.default_stream() and end.query() and s.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.npu.Event().elapsed_time(end)
    sim.uninstall()
    assert not hasattr(torch, "npu")


def test_integer_histc(npu):
    ids = torch.tensor([[3, 0], [3, 7], [1, 3]], dtype=torch.int32)  # expert ids, counted per expert
    for counts in (torch.histc(ids, bins=8, min=0, max=8), ids.histc(bins=8, min=0, max=8)):
        assert counts.dtype == torch.int32 and counts.tolist() == [1, 1, 0, 3, 0, 0, 0, 1]
    assert torch.histc(ids.long(), bins=4, min=0, max=8).tolist() == [2, 3, 0, 1]
    assert torch.equal(torch.histc(ids.float(), bins=8, min=0, max=8), torch.histc(ids.double(), 8, 0, 8).float())
    sim.uninstall()
    with pytest.raises(NotImplementedError, match="histogram"):  # CPU torch's own, restored
        torch.histc(ids, bins=8, min=0, max=8)


def _tokens(t: int = 6, k: int = 3, e: int = 5, h: int = 4):
    g = torch.Generator().manual_seed(7)
    x = torch.randn((t, h), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, ids, torch.rand((t, k), generator=g)


def test_token_permute_unpermute(npu):
    x, ids, probs = _tokens()
    t, k = ids.shape
    flat = ids.flatten().tolist()
    order = sorted(range(t * k), key=lambda i: (flat[i], i))  # stable by expert id
    permuted, sorted_idx = npu.npu_moe_token_permute(x, ids)
    assert sorted_idx.dtype == torch.int32 and sorted_idx.tolist() == order
    assert torch.equal(permuted, torch.stack([x[i // k] for i in order]))
    dropped, _ = npu.npu_moe_token_permute(x, ids, num_out_tokens=7)
    assert torch.equal(dropped, permuted[:7])
    y = (permuted.float() * 2).to(torch.bfloat16)  # "experts" double
    out = npu.npu_moe_token_unpermute(y, sorted_idx, probs)
    want = torch.zeros((t, x.shape[1]))
    for row, i in enumerate(order):
        want[i // k] += probs[i // k, i % k] * y[row].float()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    part = npu.npu_moe_token_unpermute(y[:7], sorted_idx, probs)  # dropped rows add nothing
    want = torch.zeros((t, x.shape[1]))
    for row, i in enumerate(order[:7]):
        want[i // k] += probs[i // k, i % k] * y[row].float()
    assert torch.equal(part, want.to(torch.bfloat16))


def _custom(*args, **kwargs):
    """vllm-ascend's ``torch.ops._C_ascend.npu_moe_init_routing_custom`` (its schema's quant_mode default is 0, static
    quantization, which nobody calls and the stand-in refuses: -1 unless given, as vllm-ascend always passes it)."""
    return torch.ops._C_ascend.npu_moe_init_routing_custom(*args, **{"quant_mode": -1, **kwargs})


@pytest.mark.parametrize("op", ["torch_npu", "_C_ascend"])
def test_init_routing_v2(npu, op: str):
    """torch_npu's ``npu_moe_init_routing_v2`` and vllm-ascend's custom op of the same contract (its A2 / A3 route)."""
    route = npu.npu_moe_init_routing_v2 if op == "torch_npu" else _custom
    x, ids, _ = _tokens()
    t, k = ids.shape
    flat = ids.flatten().tolist()
    lo, hi = 1, 4
    kept = sorted((i for i in range(t * k) if lo <= flat[i] < hi), key=lambda i: (flat[i], i))
    scale = torch.rand(t)
    ex, row_idx, counts, ex_scale = route(
        x,
        ids,
        scale=scale,
        expert_num=5,
        active_expert_range=[lo, hi],
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
    )
    left = sorted((i for i in range(t * k) if i not in kept), key=lambda i: (flat[i], i))
    assert torch.equal(ex, torch.stack([x[i // k] for i in kept])) and row_idx.tolist() == kept + left
    # what vllm-ascend's AllGather dispatcher does with them: unpermute the expert rows by row_idx, probs [T, K]
    probs = torch.rand((t, k))
    out = npu.npu_moe_token_unpermute(ex, row_idx, probs)
    want = torch.zeros((t, x.shape[1]))
    for row, i in enumerate(kept):
        want[i // k] += probs[i // k, i % k] * ex[row].float()
    assert torch.equal(out, want.to(torch.bfloat16))
    assert counts.tolist() == [sum(flat[i] == e for i in kept) for e in range(lo, hi)]
    assert torch.equal(ex_scale, torch.stack([scale[i // k] for i in kept]))
    _, scatter, cumsum, _ = route(x, ids, expert_num=5, row_idx_type=1, active_num=4)
    everything = sorted(range(t * k), key=lambda i: (flat[i], i))[:4]
    assert scatter.tolist() == [everything.index(i) if i in everything else -1 for i in range(t * k)]
    assert (
        cumsum.tolist() == torch.bincount(torch.tensor([flat[i] for i in everything]), minlength=5).cumsum(0).tolist()
    )
    q, _, _, q_scale = route(x, ids, quant_mode=1)
    rows = torch.stack([x[i // k] for i in sorted(range(t * k), key=lambda i: (flat[i], i))]).float()
    amax = rows.abs().amax(dim=1)
    assert q.dtype == torch.int8 and torch.equal(q_scale, amax / 127)
    assert torch.equal(q, torch.round(rows * (127 / amax)[:, None]).clamp(-127, 127).to(torch.int8))
    with pytest.raises(ValueError, match="drop_pad_mode"):
        route(x, ids, drop_pad_mode=1)


def _mega_op(info):
    sim.install()
    from cann_ops_transformer.ops import get_symm_buffer_for_mega_moe, mega_moe

    e, h, inter, k, n, w = 4, 64, 32, 2, 5, info.world_size
    g = torch.Generator().manual_seed(11)
    w1 = (torch.randn((e, h, 2 * inter), generator=g) / 8).bfloat16()
    w2 = (torch.randn((e, inter, h), generator=g) / 6).bfloat16()
    g = torch.Generator().manual_seed(info.rank)
    x = (torch.randn((n, h), generator=g) / 2).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).int()
    weights = torch.rand((n, k), generator=g)
    local = slice(info.rank * e // w, (info.rank + 1) * e // w)
    buf = get_symm_buffer_for_mega_moe(info.group, e, n, k, h, inter)
    want = mega_moe(x, ids, weights, list(w1[local]), list(w2[local]), buf, activation_clamp=0.8)
    got = torch.ops.cann_ops_transformer.npu_mega_moe(
        buf.context,
        x,
        ids,
        weights,
        list(w1[local]),
        list(w2[local]),
        e,
        w,
        buf.ccl_buffer_size,
        num_max_tokens_per_rank=n,
        activation_clamp=0.8,
    )
    sim.uninstall()
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_npu_mega_moe_op():
    assert all(parallel_launch(2, _mega_op, timeout=120))


def test_init_routing_custom_unregistered_by_uninstall():
    sim.install()
    assert hasattr(torch.ops._C_ascend, "npu_moe_init_routing_custom")
    sim.uninstall()
    assert not hasattr(torch.ops._C_ascend, "npu_moe_init_routing_custom")
