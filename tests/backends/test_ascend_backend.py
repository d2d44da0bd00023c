"""The Ascend backend.

Sim tests (run everywhere): the backend runs its real torch_npu path on ``deep_ep_npu.sim`` (the stand-in
``torch_npu``, whose ops are our engine over gloo; ``install(cann=False)``), and its ops-transformer context path on
the sim's ``cann_ops_transformer.ops.MoeDistributeBuffer`` (the V3 context ops; ``install()``), compared with the
reference backend on identical inputs, with a spy on the stand-in's ops / Buffer methods checking the argument mapping
(their own keywords only: the signatures are the documented ones, a wrong keyword is a TypeError). Neither exercises
an NPU.

Parity tests (marker ``npu``): ascend vs reference on identical inputs; skipped without torch_npu and an NPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import types

import pytest
import torch

from deep_ep_npu import Buffer, sim
from deep_ep_npu.backends.ascend import elastic_info_from_mask
from deep_ep_npu.backends.ascend_ops import map_no_expert
from tests.support.deepep_utils import calc_diff
from tests.support.distributed import parallel_launch

N, H, E, K = 8, 256, 8, 3
NOT_TORCH_NPU = {"ccl_buffer_size", "strict"}  # deep_ep_npu.ops keywords that torch_npu's ops do not have


def _record(calls: list, name: str, kwargs: dict) -> dict:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("calls", "self")}  # locals() also holds the closure
    calls.append((name, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
    calls[-1][1].update(
        {k: (v.dtype, tuple(v.shape), v.clone()) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    )
    return kwargs


def _install_sim(calls: list) -> types.ModuleType:
    """``sim.install(cann=False)`` (the torch_npu path), with its two ``_v2`` ops wrapped to record their arguments
    into ``calls`` (by name, bound to the real signature) and to refuse keywords torch_npu's ops lack."""
    torch_npu = sim.install(cann=False)
    for op in ("dispatch", "combine"):
        real = getattr(torch_npu, f"npu_moe_distribute_{op}_v2")

        def spy(*args, _real=real, _op=op, **kwargs):
            assert not NOT_TORCH_NPU & kwargs.keys(), f"not a torch_npu keyword: {NOT_TORCH_NPU & kwargs.keys()}"
            _record(calls, _op, dict(inspect.signature(_real).bind(*args, **kwargs).arguments))
            return _real(*args, **kwargs)

        setattr(torch_npu, f"npu_moe_distribute_{op}_v2", spy)
    return torch_npu


def _recorded(method, name: str, calls: list):  # noqa: ANN001, ANN202 - a method of CANN's MoeDistributeBuffer
    """``method``, recording each call's arguments by name (:func:`_record`) as ``name`` in ``calls`` first."""

    def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN202
        _record(calls, name, dict(inspect.signature(method).bind(self, *args, **kwargs).arguments))
        return method(self, *args, **kwargs)

    return wrapper


def _install_context(calls: list) -> None:
    """``sim.install()`` (CANN's extension too), its ``cann_ops_transformer.ops.MoeDistributeBuffer`` replaced by a
    subclass that records the constructor's ``ccl_buffer_size`` and the low-latency methods' arguments (by name)."""
    sim.install()
    import cann_ops_transformer.ops as ops_mod

    real = ops_mod.MoeDistributeBuffer

    class Recording(real):
        def __init__(self, group, ccl_buffer_size: int = 0, comm_alg: int = 0):
            calls.append(("init", {"ccl_buffer_size": ccl_buffer_size}))
            super().__init__(group, ccl_buffer_size, comm_alg)

        low_latency_dispatch = _recorded(real.low_latency_dispatch, "dispatch", calls)
        low_latency_combine = _recorded(real.low_latency_combine, "combine", calls)

    ops_mod.MoeDistributeBuffer = Recording


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


def _run(buffer: Buffer, x, topk_idx, weights, use_fp8: bool, overlap: str = "none", zero_copy: bool = False):
    """dispatch -> a simple expert (dequantize, times 2, bf16) -> combine; ``overlap``: "none", "hook" or "async".
    Returns recv_count, the counts of layout_range, per (expert, source) block its rows, scales and src_info (DeepEP
    leaves the order of source blocks inside an expert open), and the combined output."""
    hook, async_finish = overlap == "hook", overlap == "async"
    quant_format = "int8_per_token" if use_fp8 else None
    recv_x, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
        x, topk_idx, N, E, use_fp8=use_fp8, return_recv_hook=hook, async_finish=async_finish, quant_format=quant_format
    )
    recv_hook() if hook else event.current_stream_wait()
    data, scales = recv_x if use_fp8 else (recv_x, None)
    expert_x = data.float() if scales is None else data.float() * scales[:, :, :1]
    expert_x = (expert_x * 2).to(torch.bfloat16)  # a simple "expert"
    source = expert_x
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(handle).copy_(expert_x)
        source = torch.zeros_like(expert_x)
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
    combined, event, recv_hook = buffer.low_latency_combine(
        source,
        topk_idx,
        weights,
        handle,
        zero_copy=zero_copy,
        return_recv_hook=hook,
        async_finish=async_finish,
        out=out,
    )
    recv_hook() if hook else event.current_stream_wait()
    assert combined is out
    layout = handle.layout_range
    blocks = [
        (i, j, int(layout[i, j]) >> 32, int(layout[i, j]) & 0xFFFFFFFF)
        for i in range(layout.shape[0])
        for j in range(layout.shape[1])
    ]
    rows = [data[i, b : b + c].clone() for i, _, b, c in blocks]
    row_scales = [scales[i, b : b + c].clone() for i, _, b, c in blocks] if scales is not None else []
    src = [handle.src_info[i, b : b + c].clone() for i, _, b, c in blocks]
    return recv_count.clone(), layout & 0xFFFFFFFF, rows, row_scales, src, combined.clone()


def _assert_same(a, b, num_tokens: int) -> None:
    """Two ``_run`` results agree: counts, every received row (and scale, src_info) per block, and the combined
    output exactly (both backends end in the same engine: int8 by the same formula, combine in fp32 over top-k slots
    ascending with one cast; the ascend backend's zero experts for -1 add an exact 0)."""
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for part in (2, 3, 4):
        assert all(torch.equal(u, v) for u, v in zip(a[part], b[part], strict=True))
    assert torch.equal(a[5], b[5])
    if num_tokens:
        assert calc_diff(a[5], b[5]) < 1e-6


CASES = [
    (use_fp8, overlap, zero_copy)
    for use_fp8 in (False, True)
    for overlap, zero_copy in (("none", False), ("hook", True), ("async", False))
]


def _parity_with_standin(info, standin: str):
    calls: list = []
    _install_context(calls) if standin == "context" else _install_sim(calls)
    ref = Buffer(info.group, backend="reference")
    npu = Buffer(info.group, backend="ascend", ccl_buffer_size=64, explicitly_destroy=True)
    assert npu._backend.ops_path == ("cann_ops_transformer" if standin == "context" else "torch_npu")
    num_tokens = TOKENS[info.world_size][info.rank]
    x, topk_idx, weights = _inputs(info.rank, num_tokens)
    for cases, (use_fp8, overlap, zero_copy) in enumerate(CASES):
        calls.clear()
        a = _run(ref, x, topk_idx, weights, use_fp8, overlap, zero_copy)
        b = _run(npu, x, topk_idx, weights, use_fp8, overlap, zero_copy)
        _assert_same(a, b, num_tokens)
        # the mapping, as recorded by the spy / the stand-in
        dispatch = [kw for name, kw in calls if name == "dispatch"][0]
        combine = [kw for name, kw in calls if name == "combine"][0]
        ids_dtype, ids_shape, ids = dispatch["expert_ids" if standin == "sim" else "topk_idx"]
        # a rank without tokens sends one row routed nowhere (the NPU ops need Bs >= 1)
        assert ids_dtype == torch.int32 and ids_shape == (max(num_tokens, 1), K) and bool((ids >= 0).all())
        assert dispatch["quant_mode"] == (2 if use_fp8 else 0) and dispatch["zero_expert_num"] == K
        if standin == "sim":
            assert dispatch["group_ep"] == combine["group_ep"] == sim.hccl_comm_name(info.group)
            assert (dispatch["ep_world_size"], dispatch["ep_rank_id"]) == (info.world_size, info.rank)
            assert dispatch["global_bs"] == combine["global_bs"] == N * info.world_size
            assert dispatch["moe_expert_num"] == combine["moe_expert_num"] == E
        else:
            assert dispatch["num_max_dispatch_tokens_per_rank"] == combine["num_max_dispatch_tokens_per_rank"] == N
            assert dispatch["num_experts"] == combine["num_experts"] == E
        assert combine["zero_expert_num"] == K
        if standin == "context" and cases == 0:  # the context is built once, with the Buffer's CCL size
            assert [kw for name, kw in calls if name == "init"] == [{"ccl_buffer_size": 64}]
    _flat_vs_ops(info, calls, ref, npu, x, topk_idx, weights)
    _shrink_parity(info, calls, x, topk_idx, weights)
    npu.destroy()  # collective: a bounded barrier (c10d still picks the CPU with the "npu" device named)
    return len(CASES)


def _flat_vs_ops(info, calls: list, ref: Buffer, npu: Buffer, x, topk_idx, weights) -> None:
    """The flat methods on the sim: the same as the reference backend's and as calling torch_npu's ops directly."""
    import torch_npu

    w, total = info.world_size, None
    outs, combined = [], []
    for buffer in (ref, npu):
        out, _, hook = buffer.low_latency_dispatch_flat(
            x, topk_idx, N, E, topk_weights=weights, quant_mode=2, return_recv_hook=True
        )
        hook()
        total = int(out.handle.ep_recv_counts[-1])
        outs.append(out)
        expert_out = (out.expand_x.float() * out.dynamic_scales[:, None] * 2).to(torch.bfloat16)
        y, event, _ = buffer.low_latency_combine_flat(expert_out, topk_idx, weights, out.handle, async_finish=True)
        event.current_stream_wait()
        combined.append(y)
    ids, zero_num = map_no_expert(topk_idx, E)
    direct = torch_npu.npu_moe_distribute_dispatch_v2(
        x,
        ids,
        sim.hccl_comm_name(info.group),
        w,
        info.rank,
        E,
        expert_scales=weights,
        quant_mode=2,
        global_bs=N * w,
        zero_expert_num=zero_num,
    )
    for out in outs:
        assert torch.equal(out.expand_x[:total], direct[0][:total])
        assert torch.equal(out.dynamic_scales[:total], direct[1][:total])
        assert torch.equal(out.expert_token_nums, direct[3]) and torch.equal(out.handle.ep_recv_counts, direct[4])
        assert torch.equal(out.handle.assist_info_for_combine[: 3 * total], direct[2][: 3 * total])
    expert_out = (direct[0].float() * direct[1][:, None] * 2).to(torch.bfloat16)
    y = torch_npu.npu_moe_distribute_combine_v2(
        expert_out,
        ids,
        direct[2],
        direct[4],
        weights,
        sim.hccl_comm_name(info.group),
        w,
        info.rank,
        E,
        global_bs=N * w,
        zero_expert_num=zero_num,
    )
    assert torch.equal(combined[0], y) and torch.equal(combined[1], y)


def _shrink_parity(info, calls: list, x, topk_idx, weights) -> None:
    """Shrink mode: the mask becomes the ops' elastic_info; ascend on the sim == reference, masked and after clean."""
    masked = 1
    ref = Buffer(info.group, backend="reference", enable_shrink=True)
    npu = Buffer(info.group, backend="ascend", enable_shrink=True)
    for buffer in (ref, npu):
        buffer.low_latency_update_mask_buffer(masked, True)
    expected = elastic_info_from_mask(npu._backend.mask, E // info.world_size)
    num_tokens = x.shape[0]
    for use_fp8, overlap in ((False, "hook"), (True, "none")):
        calls.clear()
        a, b = _run(ref, x, topk_idx, weights, use_fp8, overlap), _run(npu, x, topk_idx, weights, use_fp8, overlap)
        _assert_same(a, b, num_tokens)
        if info.rank == masked:  # a masked rank receives nothing and its tokens go nowhere
            assert not b[0].any() and not b[5].any()
        for name, kw in [c for c in calls if c[0] != "init"]:
            assert torch.equal(kw["elastic_info"][2], expected), name
    for buffer in (ref, npu):
        buffer.low_latency_clean_mask_buffer()
    calls.clear()
    _assert_same(_run(ref, x, topk_idx, weights, True), _run(npu, x, topk_idx, weights, True), num_tokens)
    assert calls and all("elastic_info" not in kw for _, kw in calls)


TOKENS = {2: [5, N], 4: [N, 5, 0, N]}


@pytest.mark.parametrize(("standin", "world_size"), [("sim", 2), ("sim", 4), ("context", 4)])
def test_ascend_backend_matches_reference(standin, world_size):
    """The ascend backend on the sim (torch_npu path) or on the context stand-in vs the reference backend on identical
    inputs: bf16 / int8, plain / hook / async, zero_copy; on the sim also the flat methods vs the ops, shrink masks."""
    assert parallel_launch(world_size, _parity_with_standin, standin, timeout=120) == [len(CASES)] * world_size


def _ccl_too_small(info):
    sim.install()
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

    _, topk_idx, _ = _inputs(info.rank, 4)
    x = torch.zeros((4, 4096), dtype=torch.bfloat16)
    # torch_npu path: HCCL_BUFFSIZE (read when the backend is created) bounds the shapes
    sim.install(cann=False)
    os.environ["HCCL_BUFFSIZE"] = "2"
    buffer = Buffer(info.group, backend="ascend")
    del os.environ["HCCL_BUFFSIZE"]
    with pytest.raises(ValueError, match="HCCL_BUFFSIZE: 2 MB is too small.*at least 12 MB"):
        buffer.low_latency_dispatch(x, topk_idx, 128, E)
    # context path: the context is sized on the first call; a later call needing more is refused
    calls: list = []
    sim.uninstall()
    _install_context(calls)
    buffer = Buffer(info.group, backend="ascend")
    buffer.low_latency_dispatch(x[:, :1024], topk_idx, 8, E, use_fp8=False)
    with pytest.raises(ValueError, match="context was created on the first call") as err:
        buffer.low_latency_dispatch(x, topk_idx, 128, E)
    return [kw for name, kw in calls if name == "init"], str(err.value)


def test_ascend_contract_ccl_size_sources():
    """HCCL_BUFFSIZE (torch_npu path, on the sim) and the context's first-call size (V3 path) bound the shapes."""
    for inits, text in parallel_launch(2, _ccl_sources, timeout=60):
        assert inits == [{"ccl_buffer_size": 1}] and "at least 12 MB" in text


def test_ascend_contract_ccl_buffer_and_formats():
    """The Buffer's CCL size is checked with the needed size in the message (on the sim); fp8 is refused."""
    texts = parallel_launch(2, _ccl_too_small, timeout=60)
    assert all("ccl_buffer_size" in t for t in texts)


def test_ascend_backend_needs_torch_npu():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    from deep_ep_npu.backends import create_backend, resolve_backend_name

    assert resolve_backend_name("auto") == "reference"
    with pytest.raises(ImportError, match="torch_npu"):
        create_backend("ascend", None)


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
