"""The fused NPU op behind the ``ascend`` MegaMoE backend, and the argument mapping onto it (contract-tested).

The seed's A5 kernel (``dispatch_mega_combine_kernel``, a PTO sample with its own host executable) has no Python
binding. The fused dispatch + FFN + combine op that Python can call on Ascend is vllm-ascend's custom op
``torch.ops._C_ascend.dispatch_ffn_combine`` (aclnn ``aclnnDispatchFFNCombine`` for int8 weights,
``aclnnDispatchFFNCombineBF16`` for bf16 weights), registered when vllm-ascend's custom-op library is loaded:

```
dispatch_ffn_combine(Tensor x, Tensor[] weight1, Tensor[] weight2, Tensor expert_idx, Tensor[] scale1,
                     Tensor[] scale2, Tensor[] bias1, Tensor[] bias2, Tensor probs, str group, int max_output_size,
                     Tensor! out, Tensor! expert_token_nums, Tensor? x_active_mask=None,
                     float swiglu_limit=1000000.0) -> (Tensor, Tensor)
```

Mapping (keyword arguments, so older schemas without ``bias1/2`` fail loudly rather than shift):
``x`` -> x (bf16); ``w1`` / ``w2`` -> one-element lists, cast to the NZ format (``npu_format_cast(w, 29)``);
``topk_idx`` -> ``expert_idx`` int32; ``topk_weights`` -> ``probs`` fp32; ``w1_scale`` / ``w2_scale`` -> one-element
lists (empty int64 for bf16 weights); ``bias1/2`` -> empty fp32; ``group`` -> the HCCL comm name;
``max_output_size`` as given; ``out`` `[M, K]` in x's dtype (cast to ``out_dtype`` afterwards);
``expert_token_nums`` `[E_local]` int32. Unconfirmed: whether the int8 op wants the fp32 per-channel scales as given
or packed Fixpipe (uint64) words, and its numerics (GMM1 output rounded to fp16); NPU parity is not tested here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.distributed as dist

from .params import MegaMoeArgs

FUSED_OP = "torch.ops._C_ascend.dispatch_ffn_combine"
ACL_FORMAT_FRACTAL_NZ = 29
HIDDEN_ALIGN = 128  # the seed's tiling: K % 128 == 0
INTERMEDIATE_ALIGN = 64  # N % 64 == 0


def find_fused_op() -> Callable[..., object] | None:
    """The fused op if this process has it registered, else None (then the reference pipeline runs).

    Raises:
        ImportError: torch_npu is not installed (install the ``npu`` extra).
    """
    if importlib.util.find_spec("torch_npu") is None:
        raise ImportError("the ascend MegaMoE backend needs torch_npu: pip install 'deep_ep_npu[npu]'")
    import torch_npu  # noqa: F401  (registers the NPU device and its ops)

    try:
        return torch.ops._C_ascend.dispatch_ffn_combine
    except (AttributeError, RuntimeError):
        return None


def hccl_comm_name(group: dist.ProcessGroup, rank: int) -> str:
    """The HCCL communicator name of ``group`` (what the op's ``group`` argument expects)."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def to_npu_nz(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` on the NPU in the FRACTAL_NZ format the fused op's GMMs read."""
    import torch_npu

    return torch_npu.npu_format_cast(weight.npu(), ACL_FORMAT_FRACTAL_NZ)


def fused_op_blocker(args: MegaMoeArgs) -> str | None:
    """Why this call cannot use the fused op (None if it can)."""
    if args.x.dtype != torch.bfloat16:
        return f"x is {args.x.dtype}; the fused op takes bfloat16"
    if args.w1.dtype not in (torch.int8, torch.bfloat16):
        return f"weights are {args.w1.dtype}; the fused op takes int8 or bfloat16"
    if args.hidden % HIDDEN_ALIGN:
        return f"K = {args.hidden} is not a multiple of {HIDDEN_ALIGN}"
    if args.intermediate % INTERMEDIATE_ALIGN:
        return f"N = {args.intermediate} is not a multiple of {INTERMEDIATE_ALIGN}"
    if args.topk_idx.numel() and int(args.topk_idx.min()) < 0:
        return "topk_idx contains -1; the fused op routes every pair"
    return None


def fused_op_kwargs(
    args: MegaMoeArgs, group_name: str, prepare_weight: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, object]:
    """The keyword arguments of one fused-op call (see the module docstring for the mapping)."""
    device = args.x.device
    if args.int8_weights:
        scale1, scale2 = [args.w1_scale], [args.w2_scale]
    else:
        scale1 = [torch.empty((0,), dtype=torch.int64, device=device)]
        scale2 = [torch.empty((0,), dtype=torch.int64, device=device)]
    no_bias = [torch.empty((0,), dtype=torch.float32, device=device)]
    return {
        "x": args.x,
        "weight1": [prepare_weight(args.w1)],
        "weight2": [prepare_weight(args.w2)],
        "expert_idx": args.topk_idx.to(torch.int32),
        "scale1": scale1,
        "scale2": scale2,
        "bias1": no_bias,
        "bias2": no_bias,
        "probs": args.topk_weights,
        "group": group_name,
        "max_output_size": args.max_output_size,
        "out": torch.empty((args.num_tokens, args.hidden), dtype=args.x.dtype, device=device),
        "expert_token_nums": torch.zeros((args.num_local_experts,), dtype=torch.int32, device=device),
    }
