"""DeepEP's low-latency contract on the ``ascend`` backend: after the first call of a shape (and of a shrink mask),
steady-state calls make no host read of a tensor value in library code with value checks off
(``DEEP_EP_NPU_CHECK_VALUES=0``), counted by :class:`tests.support.host_reads.HostReads` on the NPU stand-in (whose ops,
``deep_ep_npu.ops`` / ``.cann`` / ``.sim``, stand for the device kernels and are not counted). With the default policy
on CPU tensors the value checks run (the same instrument sees them: it can fail)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from deep_ep_npu import Buffer, envs, sim
from deep_ep_npu.core import rules
from deep_ep_npu.errors import MoeDistributeError
from tests.support.distributed import parallel_launch
from tests.support.host_reads import HostReads
from tests.support.mega_moe_oracle import make_case

N, H, E, K = 4, 256, 8, 3
STAND_IN = ("ops/", "cann/", "sim/")  # the stand-in's ops: the NPU kernels


def _inputs(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + step)
    x = torch.randn((N, H), generator=g).to(torch.bfloat16)
    topk_idx = torch.rand((N, E), generator=g).topk(K, dim=1).indices
    topk_idx[0, 1] = -1
    return x, topk_idx, torch.rand((N, K), generator=g)


def _low_latency(buffer: Buffer, step: int, use_fp8: bool) -> torch.Tensor:
    x, topk_idx, weights = _inputs(buffer.rank, step)
    fmt = "int8_per_token" if use_fp8 else None
    recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, N, E, use_fp8=use_fp8, quant_format=fmt, return_recv_hook=True
    )
    hook()
    data = recv_x[0].float() * recv_x[1][:, :, :1] if use_fp8 else recv_x.float()
    out, _, hook = buffer.low_latency_combine((data * 2).to(torch.bfloat16), topk_idx, weights, handle)
    return out


def _flat(buffer: Buffer, step: int, use_fp8: bool) -> torch.Tensor:
    x, topk_idx, weights = _inputs(buffer.rank, step)
    out, _, _ = buffer.low_latency_dispatch_flat(
        x, topk_idx, N, E, topk_weights=weights, quant_mode=2 if use_fp8 else 0
    )
    rows = out.expand_x.float() * out.dynamic_scales[:, None] if use_fp8 else out.expand_x.float()
    y, _, _ = buffer.low_latency_combine_flat((rows * 2).to(torch.bfloat16), topk_idx, weights, out.handle)
    return y


def _policy(value: str) -> None:
    """Set ``DEEP_EP_NPU_CHECK_VALUES`` (read once per process: the cached value is dropped)."""
    os.environ["DEEP_EP_NPU_CHECK_VALUES"] = value
    envs.check_values.cache_clear()


@pytest.fixture
def policy(monkeypatch):
    """``policy(value)`` sets ``DEEP_EP_NPU_CHECK_VALUES`` for this test only."""
    yield lambda value: (monkeypatch.setenv("DEEP_EP_NPU_CHECK_VALUES", value), envs.check_values.cache_clear())
    monkeypatch.undo()
    envs.check_values.cache_clear()


def _steady_reads(info, cann: bool) -> dict[str, list[str]]:
    """Per front-end call: the library's host reads of its second call (first: warm-up) with checks off, masked and
    not; and the default policy's (CPU: checks on)."""
    sim.install(cann=cann)
    buffer = Buffer(info.group, backend="ascend", enable_shrink=True)
    reads: dict[str, list[str]] = {}
    for policy in ("0", ""):
        _policy(policy)
        for masked in (False, True):
            if masked:
                buffer.low_latency_update_mask_buffer(1, True)
            for name, call in (("low_latency", _low_latency), ("flat", _flat)):
                for use_fp8 in (False, True):
                    call(buffer, 0, use_fp8)
                    with HostReads(device=STAND_IN) as seen:
                        call(buffer, 1, use_fp8)
                    reads[f"{name} fp8={use_fp8} masked={masked} checks={policy!r}"] = list(seen)
            buffer.low_latency_clean_mask_buffer()
    return reads


def _assert_reads(results: list[dict[str, list[str]]]) -> None:
    for rank, reads in enumerate(results):
        off = {k: v for k, v in reads.items() if "checks='0'" in k}
        assert off and not any(off.values()), f"rank {rank}: host reads with checks off: {off}"
        # checks on (CPU): the flat combine reads its counts (the masked calls' id checks run in a native kernel)
        on = [k for k, v in reads.items() if "flat" in k and "checks=''" in k and not any("core/" in r for r in v)]
        assert not on, f"rank {rank}: the value checks on CPU read nothing (the instrument misses them): {on}"


def test_host_reads_sees_library_reads_only(policy):
    """The instrument records a library frame's reads (each kind), not a test's, nor any below a ``device`` path."""
    policy("1")
    mask, ids = torch.tensor([True, True, False]), torch.tensor([[0, 1], [2, 2]])
    with HostReads() as reads:
        assert bool(mask.any()) and mask.sum().item() == 2 and ids.tolist()  # the test's own: not counted
        rules.prefix_mask(mask, 3)
        with pytest.raises(MoeDistributeError, match="twice"):
            rules.expert_ids(ids.int(), "topk_idx", 4, 2, 8, True, active=torch.ones((2, 2), dtype=torch.bool))
    assert reads and all(r.startswith("core/rules.py:") for r in reads), reads
    assert {"(__int__)", "(__bool__)", "(nonzero)", "(tolist)"} <= {r.split()[-1] for r in reads}, reads
    with HostReads(device=("core/",)) as below:
        rules.prefix_mask(mask, 3)
    assert not below
    policy("0")
    with HostReads() as off:
        rules.prefix_mask(mask, 3)
        rules.expert_ids(ids.int(), "topk_idx", 4, 2, 8, True, active=torch.ones((2, 2), dtype=torch.bool))
    assert not off


def test_ascend_buffer_steady_state_reads_nothing_on_torch_npu_ops():
    _assert_reads(parallel_launch(2, _steady_reads, False, timeout=120))


def test_ascend_buffer_steady_state_reads_nothing_on_context_ops():
    _assert_reads(parallel_launch(2, _steady_reads, True, timeout=120))


def test_check_values_policy(policy):
    """Unset: CPU tensors only; 1: everywhere; 0: nowhere; anything else is refused, naming the variable."""
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")  # (meta: a tensor off the host)
    for value, want in (("", (True, False)), ("1", (True, True)), ("0", (False, False))):
        policy(value)
        assert (rules.values_checked(cpu), rules.values_checked(meta)) == want, value
    policy("yes")
    with pytest.raises(ValueError, match="DEEP_EP_NPU_CHECK_VALUES: must be 0 or 1"):
        rules.values_checked(cpu)


def _mega_reads(info) -> tuple[list[str], bool, torch.Tensor, torch.Tensor]:
    """Buffer(backend="ascend").mega_moe on the stand-in's fused op, ids with -1 and a mask (int8): the second call's
    host reads with checks off, whether it gave the first call's result, and the result beside the reference
    backend's."""
    sim.install()
    _policy("0")
    case = make_case(40, [6, 5], 128, 64, 3, 2, holes=0.2, inactive=[2, 1], swiglu_limit=0.5)
    x, idx, p, w1, w2, *_ = case.rank_args(info.rank)
    kw = dict(
        case.keywords(info.rank, info.world_size),
        swiglu_limit=0.5,
        x_active_mask=case.mask(info.rank),
    )
    npu, ref = Buffer(info.group, backend="ascend"), Buffer(info.group, backend="reference")
    first = npu.mega_moe(x, idx, p, w1, w2, **kw)
    with HostReads(device=STAND_IN) as seen:
        again = npu.mega_moe(x, idx, p, w1, w2, **kw)
    return list(seen), torch.equal(first, again), first, ref.mega_moe(x, idx, p, w1, w2, **kw)


def test_ascend_mega_moe_steady_state_reads_nothing():
    """The fused op takes the call (a -1 goes to an expert the token does not list, weight 0) after one agreement;
    then no round and no host read, and the result is the reference pipeline's."""
    for rank, (reads, same, fused, reference) in enumerate(parallel_launch(2, _mega_reads, timeout=120)):
        assert not reads and same, (rank, reads)
        assert torch.equal(fused, reference), rank


def _v3_reads(info) -> tuple[list[str], list[str]]:
    """MoeDistributeBuffer on the reference engine, checks off: the second dispatch + combine's host reads in the
    front-end layers (the context ops and the Buffer: ``ops/``, ``cann/``) and in all library code."""
    from deep_ep_npu.cann import MoeDistributeBuffer

    _policy("0")
    buffer = MoeDistributeBuffer(info.group)
    x, _, weights = _inputs(info.rank, 0)
    ids = torch.rand((N, E), generator=torch.Generator().manual_seed(info.rank)).topk(K).indices.int()
    reads: list[str] = []
    for _ in range(2):
        with HostReads() as seen:
            out = buffer.low_latency_dispatch(x, ids, E, topk_weights=weights, num_max_dispatch_tokens_per_rank=N)
            buffer.low_latency_combine(out[0], ids, weights, out[2], out[4], num_experts=E)
        reads = list(seen)
    return [r for r in reads if r.startswith(("ops/", "cann/"))], reads


def test_v3_context_front_end_reads_its_context_once():
    """The V3 ops read their communication context once per context tensor (and per in-place change), not per call;
    the reference engine below them plans on the host with the CPU kernels on (the instrument sees those reads)."""
    for rank, (front_end, everything) in enumerate(parallel_launch(2, _v3_reads, timeout=120)):
        assert not front_end and everything, (rank, front_end)


def _reference_reads(info) -> dict[str, tuple[list[str], list[str]]]:
    """The ``_v2`` ops (bf16 and int8 per token, a 2D mask, weights, ``shared_expert_x``, ``global_bs``),
    MoeDistributeBuffer and Buffer's low-latency dispatch / combine (bf16, fp8, int8 per token; the collective
    transport) on the reference engine with checks off and the torch code (the CPU kernels off, as a device runs it):
    per call, the second run's host reads in all library code and the collectives it issued."""
    from deep_ep_npu import kernels, ops
    from deep_ep_npu.cann import MoeDistributeBuffer
    from deep_ep_npu.transports.group import EPGroup

    _policy("0")
    kw = dict(group_ep=info.group, ep_world_size=info.world_size, ep_rank_id=info.rank, moe_expert_num=E)
    buffer, out, issued = MoeDistributeBuffer(info.group), {}, []
    deepep = Buffer(info.group, transport="collective")
    real = EPGroup.start
    EPGroup.start = lambda group, launch, op: issued.append(op) or real(group, launch, op)  # type: ignore[method-assign]

    def v2(quant_mode: int, step: int) -> None:
        x, _, weights = _inputs(info.rank, step)
        ids = torch.rand((N, E), generator=torch.Generator().manual_seed(info.rank + step)).topk(K).indices.int()
        mask = torch.rand((N, K), generator=torch.Generator().manual_seed(step)) > 0.3
        got = ops.moe_distribute_dispatch_v2(
            x,
            ids,
            **kw,
            x_active_mask=mask,
            expert_scales=weights,
            quant_mode=quant_mode,
            global_bs=N * info.world_size,
        )
        rows = got[0].float() * got[1][:, None] if quant_mode else got[0].float()
        ops.moe_distribute_combine_v2(
            rows.to(torch.bfloat16),
            ids,
            got[2],
            got[4],
            weights,
            **kw,
            x_active_mask=mask,
            shared_expert_x=x,
            global_bs=N * info.world_size,
        )

    def v3(step: int) -> None:
        x, _, weights = _inputs(info.rank, step)
        ids = torch.rand((N, E), generator=torch.Generator().manual_seed(info.rank + step)).topk(K).indices.int()
        got = buffer.low_latency_dispatch(x, ids, E, topk_weights=weights, num_max_dispatch_tokens_per_rank=N)
        buffer.low_latency_combine(got[0], ids, weights, got[2], got[4], num_experts=E)

    def low_latency(use_fp8: bool, fmt: str | None, step: int) -> None:
        x, topk_idx, weights = _inputs(info.rank, step)
        topk_idx[1, 0] = -1
        recv_x, _, handle, _, _ = deepep.low_latency_dispatch(x, topk_idx, N, E, use_fp8=use_fp8, quant_format=fmt)
        data = recv_x[0].float() * recv_x[1][:, :, :1] if use_fp8 else recv_x.float()
        deepep.low_latency_combine(data.to(torch.bfloat16), topk_idx, weights, handle)

    try:
        with kernels.disabled():
            calls = {"v2": partial(v2, 0), "v2 int8": partial(v2, 2), "MoeDistributeBuffer": v3}
            calls |= {
                f"Buffer {f}": partial(low_latency, f is not None, f) for f in (None, "fp8_e4m3", "int8_per_token")
            }
            for name, call in calls.items():
                call(0)
                issued.clear()
                with HostReads() as seen:
                    call(1)
                out[name] = (list(seen), list(issued))
    finally:
        EPGroup.start = real  # type: ignore[method-assign]
    return out


def test_reference_engine_ops_steady_state_read_nothing():
    """The ``_v2`` ops, MoeDistributeBuffer and Buffer's low-latency calls on the reference engine, checks off, the
    torch code: no host read of a tensor value in library code, one collective per dispatch and per combine (the
    static rounds: :mod:`deep_ep_npu.engine.static_flat`, :mod:`deep_ep_npu.engine.static_masked`)."""
    for rank, per_call in enumerate(parallel_launch(2, _reference_reads, timeout=120)):
        assert len(per_call) == 6, per_call.keys()
        for name, (reads, collectives) in per_call.items():
            assert not reads, (rank, name, reads)
            want = ["moe_distribute_dispatch_v2", "moe_distribute_combine_v2"]
            if name.startswith("Buffer"):
                want = ["low_latency_dispatch", "low_latency_combine"]
            assert collectives == want, (rank, name, collectives)


def _elastic_reads(info) -> dict[str, list[str]]:
    """DeepEP V2's ElasticBuffer on the ascend backend, checks off, no CPU sync: the host reads of a fresh dispatch
    (after one warm-up), of a cached one (its handle's) and of a combine, expand layout and not."""
    from deep_ep_npu import ElasticBuffer

    sim.install()
    _policy("0")
    buffer = ElasticBuffer(info.group, num_max_tokens_per_rank=N, hidden=H, explicitly_destroy=True, backend="ascend")
    x, topk_idx, _ = _inputs(info.rank, 0)
    reads: dict[str, list[str]] = {}
    for expand in (False, True):
        buffer.dispatch(x, topk_idx, num_experts=E, do_cpu_sync=False, do_expand=expand)  # (warm-up)
        with HostReads(device=STAND_IN) as fresh:
            recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx, num_experts=E, do_cpu_sync=False, do_expand=expand)
        reads[f"fresh dispatch expand={expand}"] = list(fresh)
        with HostReads(device=STAND_IN) as cached:
            again, _, _, _, _ = buffer.dispatch(x, handle=handle, do_expand=expand)
        with HostReads(device=STAND_IN) as combined:
            buffer.combine(again, handle)
        reads[f"cached dispatch expand={expand}"], reads[f"combine expand={expand}"] = list(cached), list(combined)
        if not expand:  # (the received rows; past them the rows are unspecified without CPU sync, as DeepEP's)
            num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
            assert torch.equal(again[:num_recv], recv_x[:num_recv])
    buffer.destroy()
    return reads


def test_elastic_buffer_steady_state_reads_nothing():
    """ElasticBuffer on the ascend backend without CPU sync: a fresh dispatch (placed from the op's outputs with index
    tensors at the worst-case shapes), a cached one (the op places rows as the handle's dispatch did) and the combine
    make no host read; not yet the fresh expand layout (it reads the op's counts to place its pairs)."""
    for rank, reads in enumerate(parallel_launch(2, _elastic_reads, timeout=120)):
        still = reads.pop("fresh dispatch expand=True")
        assert reads and not any(reads.values()), (rank, reads)
        assert still, "the instrument sees the fresh expand layout's reads"
