"""MegaMoE backends by name (``reference``, ``ascend``, ``auto``) and the mapping onto the fused NPU op.

The A5 PTO MegaMoE kernel (``dispatch_mega_combine_kernel``) has no Python binding; the fused op Python can call is
vllm-ascend's ``torch.ops._C_ascend.dispatch_ffn_combine`` (aclnn ``aclnnDispatchFFNCombine`` for int8 weights,
``aclnnDispatchFFNCombineBF16`` for bf16 / fp16 ones), registered by vllm-ascend's custom-op library:
``dispatch_ffn_combine(Tensor x, Tensor[] weight1, Tensor[] weight2, Tensor expert_idx, Tensor[] scale1, Tensor[]
scale2, Tensor[] bias1, Tensor[] bias2, Tensor probs, str group, int max_output_size, Tensor! out, Tensor!
expert_token_nums, Tensor? x_active_mask=None, float swiglu_limit=1000000.0) -> (Tensor, Tensor)``.

:func:`fused_op_kwargs` passes keywords (older schemas without ``bias1/2`` fail loudly rather than shift): one-item
weight lists ``[w1]`` `[E_local, K, 2N]` / ``[w2]`` `[E_local, N, K]` in the NZ format (``npu_format_cast(w, 29)``;
the op also takes E_local-long lists of `[K, 2N]` / `[N, K]`), ``expert_idx`` int32 (rows outside the mask: 0, the
kernel replaces them by E anyway), ``probs`` fp32, ``out`` in x's dtype, ``expert_token_nums`` int32 `[E_local]`
(the op writes each local expert's received rows), ``x_active_mask`` and ``swiglu_limit`` (0.0 = no clamp: the
kernel clamps only when it is > 0; the schema's default 1e6 is a clamp at 1e6).

Scale format (int8 weights): ``scale1`` / ``scale2`` are int64 Fixpipe words, each the fp32 scale's bit pattern
read as int32 and widened (sign-extended) to int64 (:func:`fixpipe_scale`; the inverse, :func:`fixpipe_scale_value`,
is exact). Evidence: vllm-ascend's ``w8a8_dynamic.py`` builds ``fused_w1_scale`` / ``fused_w2_scale`` for this op
as ``np.frombuffer(fp32 bytes, int32).astype(int64)``; the op def declares both inputs ``DT_INT64`` and the kernel
reads them as ``uint64_t`` Fixpipe scales; sgl-kernel-npu's ``DISPATCH_FFN_COMBINE`` fuse mode also passes int64
bit-pattern scales. Bias lists are ``[empty fp32]`` (vllm-ascend's W8A8 value; only the W4A8 kernel reads them).

When the op is used (:func:`fused_op_blocker`): x bf16 / fp16 with ``out_dtype`` equal to it (the op writes ``out``
in x's dtype, so any other ``out_dtype`` would round twice), int8 weights or weights of x's dtype, K % 128 == 0,
N % 64 == 0, no -1 among the active tokens' ids, and, for float weights, no inactive token and no clamp: vllm-ascend's
adapter passes neither ``x_active_mask`` nor ``swiglu_limit`` to ``aclnnDispatchFFNCombineBF16``. Under
:mod:`deep_ep_npu.sim` the op is :mod:`deep_ep_npu.sim.fused` (our engine, on CPU tensors); NPU parity is not tested.
"""

import abc
import importlib.util
import sys
from collections.abc import Callable

import torch

from ..backends import hccl_comm_name, npu_available
from .params import MegaMoeArgs
from .pipeline import run_reference

ACL_FORMAT_FRACTAL_NZ = 29
HIDDEN_ALIGN, INTERMEDIATE_ALIGN = 128, 64  # the A5 PTO MegaMoE kernel's tiling: K % 128 == 0, N % 64 == 0
FUSED_X_DTYPES = (torch.bfloat16, torch.float16)  # the op's x / out dtypes (out is x's)


def find_fused_op() -> Callable[..., object] | None:
    """The fused op if this process has it registered, else None. Raises ImportError without torch_npu."""
    if importlib.util.find_spec("torch_npu") is None:
        raise ImportError("the ascend MegaMoE backend needs torch_npu: pip install 'deep_ep_npu[npu]'")
    import torch_npu  # noqa: F401  (registers the NPU device and its ops)

    try:
        return torch.ops._C_ascend.dispatch_ffn_combine
    except (AttributeError, RuntimeError):
        return None


def npu_device_type() -> str:
    """The device type the fused op's tensors live on: the stand-in's ``device_type`` ("cpu") when the loaded
    ``torch_npu`` is :mod:`deep_ep_npu.sim`'s, else ``"npu"``."""
    mod = sys.modules.get("torch_npu")
    return str(getattr(mod, "device_type", "npu")) if getattr(mod, "SIMULATED", False) else "npu"


def to_npu_nz(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (already on the op's device) in the FRACTAL_NZ format the fused op's GMMs read."""
    import torch_npu

    return torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)  # type: ignore[attr-defined]


def fixpipe_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 per-channel scales -> the op's int64 Fixpipe words (fp32 bits as int32, sign-extended), same shape."""
    return scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def fixpipe_scale_value(words: torch.Tensor) -> torch.Tensor:
    """The fp32 scales that int64 Fixpipe ``words`` hold (the low 32 bits; exact inverse of :func:`fixpipe_scale`)."""
    return words.to(torch.int32).contiguous().view(torch.float32)


def fused_op_blocker(args: MegaMoeArgs) -> str | None:
    """Why this call cannot use the fused op (None if it can; the module docstring lists the conditions)."""
    x, wdt, active = args.x.dtype, args.w1.dtype, args.num_active
    if x not in FUSED_X_DTYPES:
        return f"x is {x}; the fused op takes {[str(d) for d in FUSED_X_DTYPES]}"
    if args.out_dtype != x:
        return f"out_dtype {args.out_dtype} differs from x's {x}; the fused op writes out in x's dtype"
    if wdt != torch.int8 and wdt != x:
        return f"weights are {wdt}; the fused op takes int8 weights or weights of x's dtype {x}"
    if args.hidden % HIDDEN_ALIGN:
        return f"K = {args.hidden} is not a multiple of {HIDDEN_ALIGN}"
    if args.intermediate % INTERMEDIATE_ALIGN:
        return f"N = {args.intermediate} is not a multiple of {INTERMEDIATE_ALIGN}"
    if active and int(args.topk_idx[:active].min()) < 0:
        return "topk_idx contains -1 in an active token; the fused op routes every pair"
    if wdt != torch.int8 and (active < args.num_tokens or args.swiglu_limit > 0):
        return "the fused op's float-weight kernel ignores x_active_mask and swiglu_limit"
    return None


def fused_op_kwargs(args: MegaMoeArgs, group_name: str, prepare_weight: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The keyword arguments of one fused-op call (the mapping of the module docstring)."""
    dev = args.x.device
    no_scale, no_bias = ([torch.empty((0,), dtype=dt, device=dev)] for dt in (torch.int64, torch.float32))
    scale1, scale2 = no_scale, no_scale
    if args.w1_scale is not None and args.w2_scale is not None:
        scale1, scale2 = [fixpipe_scale(args.w1_scale.to(dev))], [fixpipe_scale(args.w2_scale.to(dev))]
    return dict(
        x=args.x, weight1=[prepare_weight(args.w1.to(dev))], weight2=[prepare_weight(args.w2.to(dev))],
        expert_idx=args.topk_idx.clamp(min=0).to(torch.int32), scale1=scale1, scale2=scale2, bias1=no_bias,
        bias2=no_bias, probs=args.topk_weights, group=group_name, max_output_size=args.max_output_size,
        out=torch.empty((args.num_tokens, args.hidden), dtype=args.x.dtype, device=dev),
        expert_token_nums=torch.zeros((args.num_local_experts,), dtype=torch.int32, device=dev),
        x_active_mask=args.x_active_mask, swiglu_limit=args.swiglu_limit,
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
    op's layout (default :func:`to_npu_nz`); device_type, the device x must be on for the fused op (default
    :func:`npu_device_type`: "npu", or the stand-in's "cpu")."""

    name = "ascend"

    def __init__(self, fused_op: Callable[..., object] | None = None, group_name: Callable[..., str] | None = None,
                 prepare_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device_type: str | None = None) -> None:  # fmt: skip
        self.fused_op = fused_op if fused_op is not None else find_fused_op()
        self.group_name, self.prepare_weight = group_name or hccl_comm_name, prepare_weight or to_npu_nz
        self.device_type = device_type or npu_device_type()

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
