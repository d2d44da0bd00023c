"""SGLang's released DeepEP token dispatcher (sglang 0.5.23, ``DeepEPDispatcher``, unmodified) on
``deep_ep_npu.Buffer`` over 2 gloo ranks, in its ``normal``, ``low_latency`` and ``auto`` modes, on both of its
platform branches (module globals SGLang sets at import, set here after import: this CPU host has neither device):

- Ascend (``deepep._is_npu``): passes DeepEP-Ascend's ``topk_weights=`` to ``low_latency_dispatch``, picks
  quantization keywords from ``Buffer.dispatch``'s signature, hands normal mode's expert outputs straight to
  ``combine``, ``expert_alignment=1``;
- CUDA with DeepGEMM (``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM``, without which its normal-mode combine raises):
  DeepEP's own keywords, ``expert_alignment=128``; ``torch.cuda.get_device_properties`` answers an H100's SM count
  (it only sizes a warning).

Stubbed for the import only: ``torchvision`` (PyPI's build is CUDA's and cannot load beside CPU torch; only model
configs SGLang imports at module level use it, after transformers was told it is absent). Server arguments come from
SGLang's own test helper (``override_server_args``: ``--moe-a2a-backend deepep --deepep-mode MODE``, bf16 dispatch).
The dispatch / combine code runs as SGLang calls it; the test plays the experts on what ``dispatch`` returns (normal:
received tokens with their local top-k ids and weights, weighted and summed per token, and
``num_recv_tokens_per_expert`` checked against the alignment; low latency: the [experts, tokens, H] batches with
``masked_m``, weighted by ``combine``) and checks the combined tokens against a dense single-process MoE. ``auto``
switches normal -> low latency -> normal -> low latency by SGLang's ``is_extend_in_batch`` flag (prefill / decode
batches), which makes it clean the low-latency buffer at each switch. The CUDA branch's low latency also runs with
``--deepep-dispatcher-output-dtype fp8`` (DeepEP's block-128 fp8 tokens with fp32 scales, Hopper's DeepGEMM form)."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.distributed import parallel_launch

from .support import assert_close, dense_moe, enter, expert, fp8_blocks, per_token, require, stub_packages, tokens

HIDDEN, EXPERTS, TOPK, TOKENS = 256, 8, 3, 6
_H100 = SimpleNamespace(multi_processor_count=132)  # what the CUDA branch reads of the GPU (a warning's threshold)


def _experts_normal(out, rank: int, local: int) -> torch.Tensor:
    """Normal mode: per received token, sum over its local top-k slots of weight * expert output (bf16 [M, H])."""
    y = torch.zeros(out.hidden_states.shape, dtype=torch.float32)
    for i in range(out.hidden_states.shape[0]):
        for slot in range(out.topk_ids.shape[1]):
            e = int(out.topk_ids[i, slot])
            if e >= 0:
                assert e < local
                y[i] += out.topk_weights[i, slot] * expert(rank * local + e, out.hidden_states[i : i + 1])[0].float()
    return y.to(torch.bfloat16)


def _experts_ll(out, rank: int, local: int) -> torch.Tensor:
    """Low latency, as each branch's MoE runner reads it. CUDA (DeepEP's layout): each local expert on its first
    ``masked_m`` rows of [local, tokens, H]; fp8 rows are dequantized with ``hidden_states_scale`` [local, tokens,
    H / 128] fp32 first, as DeepGEMM's fp8 grouped GEMM reads them. Ascend (DeepEP-Ascend's layout, SGLang's
    ``pre_permute_deepep_ll_to_ascend``): grouped rows [A, H], ``masked_m`` the int64 group list (counts), int8 rows
    times their per-row ``hidden_states_scale`` [A] fp32. Returns bf16 in the rows' layout."""
    from sglang.srt.layers.moe.token_dispatcher import deepep

    x, scale = out.hidden_states, out.hidden_states_scale
    assert x.dim() == (2 if deepep._is_npu else 3), x.shape
    if deepep._is_npu:
        assert out.masked_m.dtype == torch.int64
        if scale is not None:
            assert x.dtype == torch.int8 and scale.shape == x.shape[:1] and scale.dtype == torch.float32
            x = (x.float() * scale[:, None]).to(torch.bfloat16)
        y, start = torch.zeros_like(x), 0
        for le, n in enumerate(out.masked_m.tolist()):
            y[start : start + n] = expert(rank * local + le, x[start : start + n])
            start += n
        return y
    if scale is not None:
        assert x.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        x = (x.float() * scale.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    y = torch.zeros_like(x)
    for le in range(local):
        n = int(out.masked_m[le])
        y[le, :n] = expert(rank * local + le, x[le, :n])
    return y


def _counts_ok(out, alignment: int) -> bool:
    """Normal mode's ``num_recv_tokens_per_expert``: each local expert's received tokens, rounded up to
    ``expert_alignment``."""
    exact = [int((out.topk_ids == e).sum()) for e in range(len(out.num_recv_tokens_per_expert))]
    return list(out.num_recv_tokens_per_expert) == [-(-n // alignment) * alignment for n in exact]


def _mode(info, mode: str, alignment: int, dtype: str = "bf16") -> list[tuple[str, torch.Tensor]]:
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.moe.token_dispatcher import deepep
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.runtime_context import get_context, get_resources

    # its server arguments, published by its own test helper: as `--moe-a2a-backend deepep --deepep-mode MODE`
    override = get_context().override_server_args(
        moe_a2a_backend="deepep", deepep_mode=mode, deepep_dispatcher_output_dtype=dtype
    )
    override.install()
    get_resources().buffers.pop("deepep_ep_state", None)  # a new process as far as SGLang's buffer goes
    local = EXPERTS // info.world_size
    dispatcher = deepep.DeepEPDispatcher(
        group=info.group,
        router_topk=TOPK,
        num_experts=EXPERTS,
        num_local_experts=local,
        hidden_size=HIDDEN,
        params_dtype=torch.bfloat16,
        deepep_mode=DeepEPMode(mode),
        async_finish=True,
        return_recv_hook=True,
    )
    x, ids, w = tokens(info.rank, TOKENS, HIDDEN, EXPERTS, TOPK)
    results = []
    for extend in {"normal": [True], "low_latency": [False], "auto": [True, False, True, False]}[mode]:
        dp_attention.set_is_extend_in_batch(extend)  # prefill (normal) or decode (low latency) batch
        topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=torch.zeros((TOKENS, EXPERTS)))
        out = dispatcher.dispatch(x, topk)
        if isinstance(out, deepep.DeepEPNormalDispatchOutput):
            assert _counts_ok(out, alignment), (out.num_recv_tokens_per_expert, out.topk_ids)
            y = _experts_normal(out, info.rank, local)
        else:
            y = _experts_ll(out, info.rank, local)
        results.append((type(out).__name__, dispatcher.combine((y, out.topk_ids, out.topk_weights))))
    override.restore()
    return results


def _rank(info, path: str) -> dict[str, list[tuple[str, torch.Tensor]]]:
    enter(path)
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # cached: transformers keeps away from the stub below
    stub_packages("torchvision")
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe.token_dispatcher import deepep

    from deep_ep_npu.buffer_deepep_ascend import DeepEPAscendBuffer

    results = {}
    for branch in ("ascend", "cuda"):  # see the module docstring
        deepep._is_npu = branch == "ascend"
        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = branch == "cuda"
        # Ascend: `import deep_ep` with DEEP_EP_NPU_ALIAS_API=deep_ep_ascend (DeepEP-Ascend's low-latency layout)
        ascend_api = mock.patch.object(deepep, "Buffer", DeepEPAscendBuffer) if branch == "ascend" else nullcontext()
        with ascend_api, mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: _H100):
            for mode in ("normal", "low_latency", "auto"):
                results[f"{branch} {mode}"] = _mode(info, mode, alignment=128 if branch == "cuda" else 1)
            quantized = "int8" if branch == "ascend" else "fp8"  # DeepEP-Ascend's per-token int8, DeepGEMM's fp8
            results[f"{branch} low_latency {quantized}"] = _mode(info, "low_latency", 128, dtype=quantized)
    return results


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[tuple[str, torch.Tensor]]]]:
    """One 2-rank launch for both branches and the three modes (importing SGLang is most of its time):
    "BRANCH MODE" -> per rank results."""
    outs = parallel_launch(2, _rank, require("sglang"), timeout=300)
    return {case: [out[case] for out in outs] for case in outs[0]}


@pytest.mark.parametrize("branch", ["ascend", "cuda"])
@pytest.mark.parametrize(
    "mode, kinds",
    [("normal", ["Normal"]), ("low_latency", ["LL"]), ("auto", ["Normal", "LL", "Normal", "LL"])],
)
def test_sglang_deepep_dispatcher(runs, branch: str, mode: str, kinds: list[str]):
    for rank, results in enumerate(runs[f"{branch} {mode}"]):
        x, ids, w = tokens(rank, TOKENS, HIDDEN, EXPERTS, TOPK)
        assert [name.removeprefix("DeepEP").removesuffix("DispatchOutput") for name, _ in results] == kinds
        for step, (name, got) in enumerate(results):
            want = dense_moe(x, ids, w, owners=2 if "Normal" in name else 1, experts=EXPERTS)
            assert_close(got, want, f"rank {rank} {branch} {mode} step {step} ({name})")


@pytest.mark.parametrize("case", ["cuda low_latency fp8", "ascend low_latency int8"])
def test_sglang_deepep_low_latency_quantized(runs, case: str):
    """``--deepep-dispatcher-output-dtype``: CUDA + DeepGEMM (Hopper: no ``round_scale`` / ``use_ue8m0``) ``fp8``,
    DeepEP's block-128 e4m3 tokens with fp32 scales; Ascend ``int8``, DeepEP-Ascend's per-token int8 with one fp32
    scale per row (SGLang asks ``use_fp8=True`` on both). Checked against the dense MoE over the tokens quantized and
    dequantized that way; the unquantized tokens' result must not match at that tolerance (the test sees the
    quantization)."""
    for rank, results in enumerate(runs[case]):
        x, ids, w = tokens(rank, TOKENS, HIDDEN, EXPERTS, TOPK)
        ((name, got),) = results
        assert name == "DeepEPLLDispatchOutput"
        sent = fp8_blocks(x) if "fp8" in case else per_token(x, torch.int8)
        assert_close(got, dense_moe(sent, ids, w, experts=EXPERTS), f"rank {rank} {case}")
        with pytest.raises(AssertionError):
            assert_close(got, dense_moe(x, ids, w, experts=EXPERTS), "unquantized tokens")
