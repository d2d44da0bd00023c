"""MegaMoE backends by name (``reference``, ``ascend``, ``auto``) and the mapping onto the fused NPU op.

The A5 PTO MegaMoE kernel (``dispatch_mega_combine_kernel``) has no Python binding; the fused op Python can call is
vllm-ascend's ``torch.ops._C_ascend.dispatch_ffn_combine`` (aclnn ``aclnnDispatchFFNCombine`` for int8 weights,
``aclnnDispatchFFNCombineBF16`` for bf16), registered by vllm-ascend's custom-op library: ``dispatch_ffn_combine(
Tensor x, Tensor[] weight1, Tensor[] weight2, Tensor expert_idx, Tensor[] scale1, Tensor[] scale2, Tensor[] bias1,
Tensor[] bias2, Tensor probs, str group, int max_output_size, Tensor! out, Tensor! expert_token_nums, Tensor?
x_active_mask=None, float swiglu_limit=1000000.0) -> (Tensor, Tensor)``. :func:`fused_op_kwargs` passes keywords
(older schemas without ``bias1/2`` fail loudly rather than shift), weights in the NZ format (``npu_format_cast(w,
29)``) and ``out`` in x's dtype (cast to ``out_dtype`` afterwards). Unconfirmed: whether the int8 op wants the fp32
per-channel scales as given or packed Fixpipe (uint64) words, and its numerics (GMM1 output rounded to fp16); NPU
parity is not tested here.
"""

import abc
import importlib.util
from collections.abc import Callable

import torch

from ..backends import hccl_comm_name, npu_available
from .params import MegaMoeArgs
from .pipeline import run_reference

ACL_FORMAT_FRACTAL_NZ = 29
HIDDEN_ALIGN, INTERMEDIATE_ALIGN = 128, 64  # the A5 PTO MegaMoE kernel's tiling: K % 128 == 0, N % 64 == 0


def find_fused_op() -> Callable[..., object] | None:
    """The fused op if this process has it registered, else None. Raises ImportError without torch_npu."""
    if importlib.util.find_spec("torch_npu") is None:
        raise ImportError("the ascend MegaMoE backend needs torch_npu: pip install 'deep_ep_npu[npu]'")
    import torch_npu  # noqa: F401  (registers the NPU device and its ops)

    try:
        return torch.ops._C_ascend.dispatch_ffn_combine
    except (AttributeError, RuntimeError):
        return None


def to_npu_nz(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` on the NPU in the FRACTAL_NZ format the fused op's GMMs read."""
    import torch_npu

    return torch_npu.npu_format_cast(weight.npu(), ACL_FORMAT_FRACTAL_NZ)  # type: ignore[attr-defined]


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


def fused_op_kwargs(args: MegaMoeArgs, group_name: str, prepare_weight: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The keyword arguments of one fused-op call (the mapping of the module docstring)."""
    dev = args.x.device
    no_scale, no_bias = ([torch.empty((0,), dtype=dt, device=dev)] for dt in (torch.int64, torch.float32))
    scale1, scale2 = ([args.w1_scale], [args.w2_scale]) if args.int8_weights else (no_scale, no_scale)
    return dict(
        x=args.x, weight1=[prepare_weight(args.w1)], weight2=[prepare_weight(args.w2)],
        expert_idx=args.topk_idx.to(torch.int32), scale1=scale1, scale2=scale2, bias1=no_bias, bias2=no_bias,
        probs=args.topk_weights, group=group_name, max_output_size=args.max_output_size,
        out=torch.empty((args.num_tokens, args.hidden), dtype=args.x.dtype, device=dev),
        expert_token_nums=torch.zeros((args.num_local_experts,), dtype=torch.int32, device=dev),
    )  # fmt: skip


class MegaMoeBackend(abc.ABC):
    """Runs one validated MegaMoE call; every rank must take the same path, so :meth:`can_fuse` is agreed first."""

    name: str

    def can_fuse(self, args: MegaMoeArgs) -> bool:  # whether this rank could run the call as one fused device op
        return False

    @abc.abstractmethod
    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        """Return `[M, K]` with ``args.out_dtype``; ``fused`` is True only if every rank's :meth:`can_fuse` was."""


class ReferenceMegaMoe(MegaMoeBackend):
    """The pipelined reference path over the two-stage ops (:mod:`deep_ep_npu.mega_moe.pipeline`)."""

    name = "reference"

    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        return run_reference(args)


class AscendMegaMoe(MegaMoeBackend):
    """The fused NPU op ``torch.ops._C_ascend.dispatch_ffn_combine`` when present, else the reference pipeline.
    Arguments (tests pass fakes): fused_op, the op (default: looked up after importing torch_npu); group_name,
    ``(ProcessGroup, rank) -> HCCL comm name`` (default :func:`hccl_comm_name`); prepare_weight, a weight into the
    op's layout (default :func:`to_npu_nz`); device_type, the device x must be on for the fused op ("npu")."""

    name = "ascend"

    def __init__(self, fused_op: Callable[..., object] | None = None, group_name: Callable[..., str] | None = None,
                 prepare_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device_type: str = "npu") -> None:  # fmt: skip
        self.fused_op = fused_op if fused_op is not None else find_fused_op()
        self.group_name, self.prepare_weight = group_name or hccl_comm_name, prepare_weight or to_npu_nz
        self.device_type = device_type

    def can_fuse(self, args: MegaMoeArgs) -> bool:
        return self.fused_op is not None and args.x.device.type == self.device_type and fused_op_blocker(args) is None

    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        if not fused:
            return run_reference(args)
        kwargs = fused_op_kwargs(args, self.group_name(args.group, args.rank), self.prepare_weight)
        self.fused_op(**kwargs)  # type: ignore[misc]
        return kwargs["out"].to(args.out_dtype)


_REGISTRY: dict[str, Callable[[], MegaMoeBackend]] = {"reference": ReferenceMegaMoe, "ascend": AscendMegaMoe}


def available_backends() -> list[str]:
    return sorted([*_REGISTRY, "auto"])


def create_backend(name: str) -> MegaMoeBackend:
    """The backend registered as ``name``; ``auto``: ``ascend`` with torch_npu and an NPU, else ``reference``."""
    if name == "auto":
        name = "ascend" if npu_available() else "reference"
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown MegaMoE backend {name!r}; available: {available_backends()}")
    return _REGISTRY[name]()
