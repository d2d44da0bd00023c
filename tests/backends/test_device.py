"""CUDA tensors through the reference path at EP world size 1, one GPU, one process (skipped without CUDA).

Each test runs the same call twice, on CUDA tensors over an NCCL world-1 group and on CPU tensors over a gloo
world-1 group, from the same inputs, and checks that every output is on the CUDA device and equals the CPU result
bit for bit. Rows the API leaves unspecified (past ``recv_count`` / the received total) are not compared.
Run them with ``bash scripts/device_check.sh`` on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer
from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2
from tests.support.deepep_utils import calc_diff, per_token_cast_back
from tests.support.ops_oracle import DISPATCH_OUTPUTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
        reason="needs a CUDA GPU and torch.distributed with NCCL",
    ),
]

T, N, H, E, K = 6, 8, 256, 4, 2  # tokens, max tokens per rank, hidden (a multiple of 128 for fp8), experts, top-k


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """``{"cuda": NCCL world-1 group, "cpu": gloo world-1 group}`` in this process, destroyed after the module."""
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("device_pg") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield {"cuda": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
    finally:
        dist.destroy_process_group()


def _inputs(seed: int, distinct_ids: bool = False):
    """CPU inputs: x `[T, H]` bf16, topk_idx `[T, K]` (int32 distinct ids, or int64 with a -1), weights fp32."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((T, H), generator=g) * 0.5).to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand((T, E), generator=g), K, dim=1).indices
    if distinct_ids:
        topk_idx = topk_idx.to(torch.int32)
    else:
        topk_idx[2, 1] = -1
    weights = torch.rand((T, K), generator=g)
    return x, topk_idx, weights


def _expert_fn(rows: torch.Tensor, device: str) -> torch.Tensor:
    """What the experts return (computed on the CPU, then moved): ``2 * rows`` in bf16."""
    return (rows.cpu().float() * 2).to(torch.bfloat16).to(device)


def _check_oracle(want: dict, seed: int, distinct_ids: bool = False) -> None:
    """The CPU run itself is right (so that equal results are not vacuous): ``2 * x * sum(weights)``."""
    x, topk_idx, weights = _inputs(seed, distinct_ids)
    oracle = 2 * x.float() * weights.masked_fill(topk_idx < 0, 0).sum(dim=1, keepdim=True)
    assert calc_diff(want["combined"], oracle) < 1e-3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _assert_same(got: dict, want: dict, device: str = "cuda") -> None:
    assert got.keys() == want.keys()
    for name, want_t in want.items():
        got_t = got[name]
        assert got_t.device.type == device, f"{name}: on {got_t.device}, expected {device}"
        got_t = got_t.cpu()
        assert (got_t.dtype, tuple(got_t.shape)) == (want_t.dtype, tuple(want_t.shape)), name
        assert torch.equal(_bits(got_t), _bits(want_t)), f"{name}: differs from the CPU / gloo result"


# ---- (a) the one-shot ops ------------------------------------------------------------------------------------------
OP_KEYS = DISPATCH_OUTPUTS


def _run_ops(device: str, group, quant_mode: int) -> dict:
    x, expert_ids, weights = (t.to(device) for t in _inputs(1, distinct_ids=True))
    outs = moe_distribute_dispatch_v2(x, expert_ids, group, 1, 0, E, expert_scales=weights, quant_mode=quant_mode)
    res = dict(zip(OP_KEYS, outs, strict=True))
    expand_x, dynamic_scales, assist, _, ep_recv_counts, _, _ = outs
    rows = expand_x.cpu().float() * dynamic_scales.cpu().unsqueeze(1) if quant_mode else expand_x
    res["combined"] = moe_distribute_combine_v2(
        _expert_fn(rows, device), expert_ids, assist, ep_recv_counts, weights, group, 1, 0, E
    )
    return res


@pytest.mark.parametrize("quant_mode", [0, 2])
def test_ops_dispatch_combine_on_cuda(groups, quant_mode):
    want = _run_ops("cpu", groups["cpu"], quant_mode)
    _check_oracle(want, 1, distinct_ids=True)
    got = _run_ops("cuda", groups["cuda"], quant_mode)
    _assert_same(got, want)


# ---- (b) Buffer.low_latency_dispatch / low_latency_combine ---------------------------------------------------------
def _run_low_latency(device: str, group, use_fp8: bool) -> dict:
    x, topk_idx, weights = (t.to(device) for t in _inputs(3))
    buffer = Buffer(group, backend="reference")
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=use_fp8)
    assert tuple(handle[2:]) == (N, H, E)
    res = {"recv_count": recv_count, "layout_range": handle.layout_range}
    data, scales = recv_x if use_fp8 else (recv_x, None)
    for i, count in enumerate(recv_count.tolist()):  # rows past recv_count are undefined
        res[f"recv_x[{i}]"] = data[i, :count]
        res[f"src_info[{i}]"] = handle.src_info[i, :count]
        if use_fp8:
            res[f"recv_scales[{i}]"] = scales[i, :count]
    rows = per_token_cast_back(data.cpu(), scales.cpu()) if use_fp8 else recv_x
    res["combined"], _, _ = buffer.low_latency_combine(_expert_fn(rows, device), topk_idx, weights, handle)
    return res


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_dispatch_combine_on_cuda(groups, use_fp8):
    want = _run_low_latency("cpu", groups["cpu"], use_fp8)
    _check_oracle(want, 3)
    got = _run_low_latency("cuda", groups["cuda"], use_fp8)
    _assert_same(got, want)


# ---- (c) Buffer.low_latency_dispatch_flat / low_latency_combine_flat -----------------------------------------------
def _run_flat(device: str, group, quant_mode: int) -> dict:
    x, topk_idx, weights = (t.to(device) for t in _inputs(4))
    buffer = Buffer(group, backend="reference")
    out, _, _ = buffer.low_latency_dispatch_flat(x, topk_idx, N, E, topk_weights=weights, quant_mode=quant_mode)
    handle = out.handle
    total = int(out.expert_token_nums.sum())  # rows past the received total are unspecified
    res = {
        "expand_x": out.expand_x[:total],
        "dynamic_scales": out.dynamic_scales[:total],
        "expert_token_nums": out.expert_token_nums,
        "assist_info_for_combine": handle.assist_info_for_combine[: 3 * total],
        "ep_recv_counts": handle.ep_recv_counts,
        "tp_recv_counts": handle.tp_recv_counts,
        "expand_scales": handle.expand_scales[:total],
    }
    expand_x = out.expand_x
    rows = expand_x.cpu().float() * out.dynamic_scales.cpu().unsqueeze(1) if quant_mode else expand_x
    res["combined"], _, _ = buffer.low_latency_combine_flat(_expert_fn(rows, device), topk_idx, weights, handle)
    return res


@pytest.mark.parametrize("quant_mode", [0, 2])
def test_flat_dispatch_combine_on_cuda(groups, quant_mode):
    want = _run_flat("cpu", groups["cpu"], quant_mode)
    _check_oracle(want, 4)
    got = _run_flat("cuda", groups["cuda"], quant_mode)
    _assert_same(got, want)


# ---- (d) a decode step captured in a CUDA graph ------------------------------------------------------------------
def _step(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> tuple:
    """dispatch -> the experts (``2 * rows``, on the device) -> combine: recv_count and the combined `[T, H]`."""
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine((recv_x.float() * 2).to(torch.bfloat16), topk_idx, weights, handle)
    return recv_count, combined


def test_low_latency_step_replays_in_a_cuda_graph(groups):
    """DeepEP's contract: Buffer dispatch -> expert -> combine on NCCL (reference backend: its static round,
    :mod:`deep_ep_npu.engine.static_masked`, no host read) captured once in ``torch.cuda.graph`` and replayed on new
    inputs copied into the captured tensors gives what the same calls give eagerly (a second Buffer), which is the
    oracle's ``2 * x * sum(weights)``. (The same calls on CPU: ``tests/engine/test_static_masked.py``.)"""
    static = [t.cuda() for t in _inputs(5)]
    captured, eager = Buffer(groups["cuda"], backend="reference"), Buffer(groups["cuda"], backend="reference")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the first call of a shape may allocate and set up
        _step(captured, *static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_count, combined = _step(captured, *static)
    for seed in (6, 7):
        for t, new in zip(static, _inputs(seed), strict=True):
            t.copy_(new)
        graph.replay()
        got = recv_count.clone(), combined.clone()
        want = _step(eager, *static)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        _check_oracle({"combined": got[1].cpu()}, seed)
