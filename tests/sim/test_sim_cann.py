"""``deep_ep_npu.sim``'s CANN extension stand-in: ``cann_ops_transformer`` / ``npu_ops_transformer`` (modules, their
``ops`` modules, ``torch.ops.<package>`` context ops, install / uninstall), and vllm-ascend's V3 adapter
(``MoeDistributeV3Adapter``, ``vllm_ascend/ops/fused_moe/moe_distribute_v3.py``) replayed argument for argument against
the ``_v2`` ops on the same inputs (bit for bit).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import ops, sim
from tests.support.distributed import parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu exists")
H, E, K = 1024, 8, 3


def _inputs(rank: int, bs: int):
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn((bs, H), generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)])
    return x, ids, torch.rand((bs, K), generator=g)


def _modules(info):
    w, r = info.world_size, info.rank
    sim.install()
    import cann_ops_transformer
    import npu_ops_transformer.ops as old_ops
    from cann_ops_transformer.ops import MoeDistributeBuffer

    assert cann_ops_transformer.MoeDistributeBuffer is MoeDistributeBuffer
    assert issubclass(old_ops.MoeDistributeBuffer, MoeDistributeBuffer)  # the old package: the old context layout
    old_buf = old_ops.MoeDistributeBuffer(info.group)
    assert old_buf.context.dtype == torch.int32 and old_buf.context.shape == (2052,)
    assert old_buf.update_ctx(info.group) and old_buf.context.shape == (2052,)
    assert old_ops.npu_moe_distribute_dispatch_v3 is ops.moe_distribute_dispatch_v3
    assert old_ops.npu_moe_distribute_combine_v2 is ops.moe_distribute_combine_v2
    buf = MoeDistributeBuffer(info.group)
    x, ids, weights = _inputs(r, 4)
    ids = ids.int()
    new, old = torch.ops.cann_ops_transformer, torch.ops.npu_ops_transformer
    a = new.npu_moe_distribute_dispatch(buf.context, x, ids, w, r, E, buf.ccl_buffer_size, quant_mode=2)
    b = old.npu_moe_distribute_dispatch_v3(old_buf.context, x, ids, w, r, E, buf.ccl_buffer_size, quant_mode=2)
    c = ops.moe_distribute_dispatch_v2(x, ids, info.group, w, r, E, quant_mode=2)
    assert all(torch.equal(u, v) and torch.equal(u, t) for u, v, t in zip(a, b, c, strict=True))
    y = (a[0].float() * a[1][:, None]).bfloat16()
    outs = [
        f(buf.context, y, ids, a[2], a[4], weights, w, r, E, buf.ccl_buffer_size)
        for f in (new.npu_moe_distribute_combine, old.npu_moe_distribute_combine_v3)
    ]
    want = ops.moe_distribute_combine_v2(y, ids, a[2], a[4], weights, info.group, w, r, E)
    assert all(torch.equal(o, want) for o in outs)
    sim.uninstall()
    gone = [p for p in ("cann_ops_transformer", "npu_ops_transformer.ops") if importlib.util.find_spec(p.split(".")[0])]
    assert not gone and not hasattr(torch.ops.cann_ops_transformer, "npu_moe_distribute_dispatch")
    sim.install(cann=False)
    assert "cann_ops_transformer" not in sys.modules and importlib.util.find_spec("torch_npu") is not None
    sim.uninstall()
    sim.install()  # again: the ops register anew
    return bool(importlib.import_module("cann_ops_transformer.ops").MoeDistributeBuffer)


def test_cann_packages_install_and_run():
    assert parallel_launch(2, _modules, timeout=60) == [True, True]


class _Adapter:
    """vllm-ascend's ``MoeDistributeV3Adapter`` (LQ @1082eee), the calls it makes, as it makes them."""

    def __init__(
        self, device_group, ep_world_size: int, max_tokens_per_rank: int, hidden: int, num_experts: int, top_k: int
    ):
        module = None
        for name in ("cann_ops_transformer.ops", "npu_ops_transformer.ops"):
            try:
                module = importlib.import_module(name)
                break
            except ImportError:
                continue
        cls = module.MoeDistributeBuffer
        ccl = cls.get_low_latency_ccl_buffer_size(
            ep_world_size, max_tokens_per_rank, hidden, num_experts, top_k, comm_alg=""
        )
        self.buffer = cls(device_group, ccl_buffer_size=ccl, comm_alg=0)
        self.ccl, self.num_experts = ccl, num_experts
        self.dispatch = getattr(self.buffer, "low_latency_dispatch", None) or self.buffer.npu_low_latency_dispatch
        self.combine = getattr(self.buffer, "low_latency_combine", None) or self.buffer.npu_low_latency_combine

    def update_ctx_to_mc2_group(self, device_group) -> None:
        if dist.get_world_size(device_group) != self.buffer.world_size or dist.get_rank(device_group) != (
            self.buffer.rank_id
        ):
            raise RuntimeError("same W and EP rank required")
        saved = self.buffer.ccl_buffer_size
        if hasattr(saved, "value"):
            saved.value = saved.value
        else:
            self.buffer.ccl_buffer_size = saved
        with torch.inference_mode():
            self.buffer.update_ctx(device_group)


def _vllm_v3(info, quant_mode: int):
    sim.install()
    w, r = info.world_size, info.rank
    device_group = dist.new_group(list(range(w)))
    adapter = _Adapter(device_group, w, 8, H, E, K)
    elastic_info = torch.tensor([0, w, 0, E, *range(w), *range(w)], dtype=torch.int32)
    results = []
    for step, bs in enumerate((6, 4)):
        hidden_states, topk_ids, topk_weights = _inputs(r + 10 * step, bs)
        mc2_mask = torch.arange(bs) < bs - 1  # graph mode: the mask has BS entries, a prefix of actual tokens
        kw = dict(x_active_mask=mc2_mask, elastic_info=elastic_info)
        expand_x, dynamic_scale, assist, expert_token_nums, ep_recv_counts, expand_scales = adapter.dispatch(
            x=hidden_states,
            topk_idx=topk_ids.to(torch.int32),
            num_experts=E,
            quant_mode=quant_mode,
            comm_alg="",
            num_max_dispatch_tokens_per_rank=topk_ids.shape[0],
            **kw,
        )
        group_list = expert_token_nums  # group_list_type 1: counts
        rows = expand_x.float() * (dynamic_scale[:, None] if quant_mode else 1)
        expert_output = (rows * 0.5).bfloat16()
        out = adapter.combine(
            x=expert_output,
            topk_idx=topk_ids.to(torch.int32),
            topk_weights=topk_weights.to(torch.float32),
            assist_info_for_combine=assist,
            ep_send_counts=ep_recv_counts,
            num_experts=E,
            comm_alg="",
            num_max_dispatch_tokens_per_rank=bs,
            ori_x=hidden_states,
            expand_scales=expand_scales,
            **kw,
        )
        # the _v2 ops on the same inputs
        v2 = ops.moe_distribute_dispatch_v2(
            hidden_states, topk_ids.int(), info.group, w, r, E, quant_mode=quant_mode, global_bs=bs * w, **kw
        )
        assert torch.equal(v2[0], expand_x) and torch.equal(v2[3], group_list) and torch.equal(v2[6], expand_scales)
        y = ((v2[0].float() * (v2[1][:, None] if quant_mode else 1)) * 0.5).bfloat16()
        want = ops.moe_distribute_combine_v2(
            y, topk_ids.int(), v2[2], v2[4], topk_weights, info.group, w, r, E, global_bs=bs * w, **kw
        )
        results.append(torch.equal(out, want) and not out[bs - 1 :].any())
        adapter.update_ctx_to_mc2_group(dist.new_group(list(range(w))))  # scale-up: a new group, same W and rank
    assert isinstance(adapter.ccl, int) and adapter.ccl > 0
    return results


@pytest.mark.parametrize(("world_size", "quant_mode"), [(2, 2), (4, 0)])
def test_vllm_ascend_v3_adapter_replay(world_size, quant_mode):
    assert parallel_launch(world_size, _vllm_v3, quant_mode, timeout=90) == [[True, True]] * world_size


def _example(info):
    sim.install()
    from examples.cann_torch_ext import demo

    return demo(info.group)


def test_readme_cann_example_runs():
    """examples/cann_torch_ext.py's ``demo`` (docs/cann.md) on 2 gloo ranks: the
    low-latency layer equals its oracle exactly, the weights come back, mega_moe gives (y, expert_token_nums)."""
    lines = parallel_launch(2, _example, timeout=90)
    assert all("low_latency: max err vs oracle 0;" in ln for ln in lines), lines
    assert all("weights echoed True" in ln and "mega_moe: y (4, 1024)" in ln for ln in lines), lines
