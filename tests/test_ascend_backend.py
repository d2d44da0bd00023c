"""The Ascend backend.

Contract tests (run everywhere): recording stand-ins for ``torch_npu`` and for ops-transformer's
``MoeDistributeBuffer`` are put into ``sys.modules``. They have exactly the documented signatures (reference
ascend_ops.md §4-§5: a wrong keyword is a TypeError), record what the backend passes, and compute the op with the
torch.distributed reimplementation in ``deep_ep_npu.ops``. So these tests check the argument mapping and the
masked <-> flat conversion end to end, against the reference backend on identical inputs. They do not exercise an NPU.

Parity tests (marker ``npu``): ascend vs reference on identical inputs; skipped without torch_npu and an NPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from deep_ep_npu import Buffer
from deep_ep_npu import ops as ref_ops
from tests.deepep_utils import calc_diff
from tests.distributed import parallel_launch

N, H, E, K = 8, 256, 8, 3


def _record(calls: list, name: str, kwargs: dict) -> dict:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("calls", "self")}  # locals() also holds the closure
    calls.append((name, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
    calls[-1][1].update(
        {k: (v.dtype, tuple(v.shape), v.clone()) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    )
    return kwargs


def _torch_npu_standin(calls: list) -> types.ModuleType:
    """torch_npu 2.14.0's two ops, with their documented signatures (ascend_ops.md §5)."""
    mod = types.ModuleType("torch_npu")

    def npu_moe_distribute_dispatch_v2(
        x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None, x_active_mask=None,
        expert_scales=None, elastic_info=None, performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
        expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0, global_bs=0,
        expert_token_nums_type=1, comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0,
        y_dtype=None, x_dtype=None, scales_dtype=None,
    ):  # fmt: skip
        kw = _record(calls, "dispatch", dict(locals()))
        return ref_ops.moe_distribute_dispatch_v2(**kw)

    def npu_moe_distribute_combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, ep_world_size,
        ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None, expand_scales=None,
        shared_expert_x=None, elastic_info=None, ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
        const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
        shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, comm_quant_mode=0, comm_alg="",
        zero_expert_num=0, copy_expert_num=0, const_expert_num=0,
    ):  # fmt: skip
        kw = _record(calls, "combine", dict(locals()))
        return ref_ops.moe_distribute_combine_v2(**kw)

    mod.npu_moe_distribute_dispatch_v2 = npu_moe_distribute_dispatch_v2
    mod.npu_moe_distribute_combine_v2 = npu_moe_distribute_combine_v2
    return mod


def _context_standin(calls: list) -> tuple[types.ModuleType, types.ModuleType]:
    """cann_ops_transformer.ops.MoeDistributeBuffer (CANN 9.1+ names; ascend_ops.md §4.1-§4.2)."""

    class MoeDistributeBuffer:
        def __init__(self, group, ccl_buffer_size: int = 0, comm_alg: int = 0):
            calls.append(("init", {"ccl_buffer_size": ccl_buffer_size}))
            self.group = group

        def low_latency_dispatch(
            self, x, topk_idx, num_experts: int, *, quant_mode=0, comm_alg="", x_smooth_scale=None,
            x_active_mask=None, topk_weights=None, zero_expert_num=0, copy_expert_num=0, const_expert_num=0,
            elastic_info=None, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
            expert_token_nums_type=1, num_max_dispatch_tokens_per_rank=0, y_dtype=None, x_dtype=None,
            x_smooth_scales_dtype=None,
        ):  # fmt: skip
            kw = _record(calls, "dispatch", dict(locals()))
            w = torch.distributed.get_world_size(self.group)
            out = ref_ops.moe_distribute_dispatch_v2(
                x, topk_idx, self.group, w, torch.distributed.get_rank(self.group), num_experts,
                scales=x_smooth_scale, x_active_mask=x_active_mask, expert_scales=topk_weights, quant_mode=quant_mode,
                global_bs=num_max_dispatch_tokens_per_rank * w, expert_token_nums_type=expert_token_nums_type,
                zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num,
            )  # fmt: skip
            del kw
            return out[:5] + out[6:]

        def low_latency_combine(
            self, x, topk_idx, topk_weights, assist_info_for_combine, ep_send_counts, *, num_experts=0, comm_alg="",
            comm_quant_mode=0, x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
            ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None, zero_expert_num=0,
            copy_expert_num=0, const_expert_num=0, expert_shared_type=0, shared_expert_num=1,
            shared_expert_rank_num=0, num_max_dispatch_tokens_per_rank=0,
        ):  # fmt: skip
            _record(calls, "combine", dict(locals()))
            w = torch.distributed.get_world_size(self.group)
            return ref_ops.moe_distribute_combine_v2(
                x, topk_idx, assist_info_for_combine, ep_send_counts, topk_weights, self.group, w,
                torch.distributed.get_rank(self.group), num_experts, x_active_mask=x_active_mask,
                shared_expert_x=shared_expert_x, global_bs=num_max_dispatch_tokens_per_rank * w,
                zero_expert_num=zero_expert_num, comm_quant_mode=comm_quant_mode,
            )  # fmt: skip

    pkg = types.ModuleType("cann_ops_transformer")
    ops_mod = types.ModuleType("cann_ops_transformer.ops")
    ops_mod.MoeDistributeBuffer = MoeDistributeBuffer
    pkg.ops = ops_mod
    return pkg, ops_mod


def _inputs(rank: int, num_tokens: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn((num_tokens, H), generator=g) * 0.5).to(torch.bfloat16)
    scores = torch.rand((num_tokens, E), generator=g)
    topk_idx = torch.topk(scores, K, dim=1).indices
    if num_tokens > 1:
        topk_idx[1, 0] = -1
        topk_idx[0, :] = -1
    weights = torch.rand((num_tokens, K), generator=g)
    return x, topk_idx, weights


def _run(buffer: Buffer, x, topk_idx, weights, use_fp8: bool, hook: bool, zero_copy: bool):
    recv_x, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
        x, topk_idx, N, E, use_fp8=use_fp8, return_recv_hook=hook, quant_format="int8_per_token" if use_fp8 else None
    )
    if hook:
        recv_hook()
    data, scales = recv_x if use_fp8 else (recv_x, None)
    expert_x = data.float() if scales is None else data.float() * scales[:, :, :1]
    expert_x = (expert_x * 2).to(torch.bfloat16)  # a simple "expert"
    source = expert_x
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(handle).copy_(expert_x)
        source = torch.zeros_like(expert_x)
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
    combined, _, recv_hook = buffer.low_latency_combine(
        source, topk_idx, weights, handle, zero_copy=zero_copy, return_recv_hook=hook, out=out
    )
    if hook:
        recv_hook()
    assert combined is out
    # DeepEP leaves the order of source blocks inside an expert open: compare block by block (expert, source)
    layout = handle.layout_range
    blocks = [
        (i, j, int(layout[i, j]) >> 32, int(layout[i, j]) & 0xFFFFFFFF)
        for i in range(layout.shape[0])
        for j in range(layout.shape[1])
    ]
    rows = [data[i, b : b + c] for i, _, b, c in blocks]
    row_scales = [scales[i, b : b + c].contiguous() for i, _, b, c in blocks] if scales is not None else []
    src = [handle.src_info[i, b : b + c] for i, _, b, c in blocks]
    return recv_count.clone(), layout & 0xFFFFFFFF, rows, row_scales, src, combined.clone()


def _parity_with_standin(info, standin: str):
    from deep_ep_npu.backends import ascend

    calls: list = []
    sys.modules["torch_npu"] = _torch_npu_standin(calls)
    if standin == "context":
        pkg, ops_mod = _context_standin(calls)
        sys.modules["cann_ops_transformer"], sys.modules["cann_ops_transformer.ops"] = pkg, ops_mod
    ascend.AscendBackend._group_name = lambda self: self.group.group_name
    ref = Buffer(info.group, backend="reference")
    npu = Buffer(info.group, backend="ascend", ccl_buffer_size=64)
    assert npu._backend.ops_path == ("cann_ops_transformer" if standin == "context" else "torch_npu")
    num_tokens = [N, 5, 0, N][info.rank]
    x, topk_idx, weights = _inputs(info.rank, num_tokens)
    cases = 0
    for use_fp8 in (False, True):
        for hook, zero_copy in ((False, False), (True, True)):
            calls.clear()
            a = _run(ref, x, topk_idx, weights, use_fp8, hook, zero_copy)
            b = _run(npu, x, topk_idx, weights, use_fp8, hook, zero_copy)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for part in (2, 3, 4):
                assert all(torch.equal(u, v) for u, v in zip(a[part], b[part], strict=True))
            if num_tokens:
                assert calc_diff(a[5], b[5]) < 1e-6 and torch.allclose(a[5].float(), b[5].float(), atol=1e-2)
            # the mapping, as recorded by the stand-in
            dispatch = [kw for name, kw in calls if name == "dispatch"][0]
            combine = [kw for name, kw in calls if name == "combine"][0]
            ids_dtype, ids_shape, ids = dispatch["expert_ids" if standin == "torch_npu" else "topk_idx"]
            # a rank without tokens sends one row routed nowhere (the NPU ops need Bs >= 1)
            assert ids_dtype == torch.int32 and ids_shape == (max(num_tokens, 1), K) and bool((ids >= 0).all())
            assert dispatch["quant_mode"] == (2 if use_fp8 else 0) and dispatch["zero_expert_num"] == K
            if standin == "torch_npu":
                assert dispatch["group_ep"] == info.group.group_name
                assert (dispatch["ep_world_size"], dispatch["ep_rank_id"]) == (info.world_size, info.rank)
                assert dispatch["global_bs"] == combine["global_bs"] == N * info.world_size
                assert dispatch["moe_expert_num"] == combine["moe_expert_num"] == E
            else:
                assert dispatch["num_max_dispatch_tokens_per_rank"] == combine["num_max_dispatch_tokens_per_rank"] == N
                assert dispatch["num_experts"] == combine["num_experts"] == E
            assert combine["zero_expert_num"] == K
            if standin == "context" and cases == 0:  # the context is built once, with the Buffer's CCL size
                assert [kw for name, kw in calls if name == "init"] == [{"ccl_buffer_size": 64}]
            cases += 1
    return cases


@pytest.mark.parametrize("standin", ["torch_npu", "context"])
def test_ascend_contract_matches_reference(standin):
    """Contract test (stand-in ops, no NPU): argument mapping + masked/flat conversion vs the reference backend."""
    assert parallel_launch(4, _parity_with_standin, standin, timeout=90) == [4] * 4


def _ccl_too_small(info):
    from deep_ep_npu.backends import ascend

    sys.modules["torch_npu"] = _torch_npu_standin([])
    ascend.AscendBackend._group_name = lambda self: self.group.group_name
    buffer = Buffer(info.group, backend="ascend", ccl_buffer_size=1)
    _, topk_idx, _ = _inputs(info.rank, 4)
    x = torch.zeros((4, 4096), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least 12 MB is needed") as err:
        buffer.low_latency_dispatch(x, topk_idx, 128, E)
    with pytest.raises(ValueError, match="fp8_e4m3 has no Ascend"):
        buffer.low_latency_dispatch(x, topk_idx, 128, E, quant_format="fp8_e4m3")
    return str(err.value)


def _ccl_sources(info):
    import os

    from deep_ep_npu.backends import ascend

    ascend.AscendBackend._group_name = lambda self: self.group.group_name
    _, topk_idx, _ = _inputs(info.rank, 4)
    x = torch.zeros((4, 4096), dtype=torch.bfloat16)
    # torch_npu path: HCCL_BUFFSIZE (read when the backend is created) bounds the shapes
    sys.modules["torch_npu"] = _torch_npu_standin([])
    os.environ["HCCL_BUFFSIZE"] = "2"
    buffer = Buffer(info.group, backend="ascend")
    del os.environ["HCCL_BUFFSIZE"]
    with pytest.raises(ValueError, match="HCCL_BUFFSIZE: 2 MB is too small.*at least 12 MB"):
        buffer.low_latency_dispatch(x, topk_idx, 128, E)
    # context path: the context is sized on the first call; a later call needing more is refused
    calls: list = []
    pkg, ops_mod = _context_standin(calls)
    sys.modules["cann_ops_transformer"], sys.modules["cann_ops_transformer.ops"] = pkg, ops_mod
    buffer = Buffer(info.group, backend="ascend")
    buffer.low_latency_dispatch(x[:, :1024], topk_idx, 8, E, use_fp8=False)
    with pytest.raises(ValueError, match="context was created on the first call") as err:
        buffer.low_latency_dispatch(x, topk_idx, 128, E)
    return [kw for name, kw in calls if name == "init"], str(err.value)


def test_ascend_contract_ccl_size_sources():
    """Contract test: HCCL_BUFFSIZE (torch_npu path) and the context's first-call size (V3 path) bound the shapes."""
    for inits, text in parallel_launch(2, _ccl_sources, timeout=60):
        assert inits == [{"ccl_buffer_size": 1}] and "at least 12 MB" in text


def test_ascend_contract_ccl_buffer_and_formats():
    """Contract test: the Buffer's CCL size is checked with the needed size in the message; fp8 is refused."""
    texts = parallel_launch(2, _ccl_too_small, timeout=60)
    assert all("ccl_buffer_size" in t for t in texts)


def test_ascend_backend_needs_torch_npu():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    from deep_ep_npu.backends import BufferConfig, create_backend, resolve_backend_name

    assert resolve_backend_name("auto") == "reference"
    with pytest.raises(ImportError, match="torch_npu"):
        create_backend("ascend", None, BufferConfig())


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()


def _npu_parity(info):
    import torch.distributed as dist

    torch.npu.set_device(info.rank)
    hccl = dist.new_group(backend="hccl")
    ref = Buffer(info.group, backend="reference")
    npu = Buffer(hccl, backend="ascend")
    num_tokens = [N, 5, 0, N][info.rank % 4]
    x, topk_idx, weights = _inputs(info.rank, num_tokens)
    dev = torch.device("npu", info.rank)
    for use_fp8 in (False, True):
        a = _run(ref, x, topk_idx, weights, use_fp8, False, False)
        b = _run(npu, x.to(dev), topk_idx.to(dev), weights.to(dev), use_fp8, False, False)
        b = [t.cpu() if isinstance(t, torch.Tensor) else [u.cpu() for u in t] for t in b]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        # the NPU's int8 may differ by one step where x * 127 / amax lands on .5; compare dequantized rows
        for u, v in zip(a[2], b[2], strict=True):
            assert (u.float() - v.float()).abs().max() <= (1 if use_fp8 else 0)
        for u, v in zip(a[4], b[4], strict=True):
            assert torch.equal(u.sort().values, v.sort().values)
        if num_tokens:
            assert calc_diff(a[5], b[5]) < (3e-3 if use_fp8 else 1e-5)
    return True


@pytest.mark.npu
@pytest.mark.skipif(not _npu_available(), reason="needs torch_npu and Ascend NPUs")
def test_ascend_vs_reference_on_npu():
    """Parity on real hardware: ascend (HCCL, NPU tensors) vs reference (gloo, CPU) on identical inputs."""
    assert parallel_launch(4, _npu_parity, timeout=300) == [True] * 4
