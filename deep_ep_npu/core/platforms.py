"""torch_npu's dtype arguments and the rules that depend on the platform of ``strict`` (which platform documents each
quant mode, comm_alg "hierarchy"'s requirements). The ops take dtypes as ``int?``: a ``torch.dtype``'s ScalarType
code (``torch.int8`` 1, ``float8_e5m2`` 23, ``float8_e4m3fn`` 24, ``float8_e8m0fnu`` 44), or the ACL dtype enum
+ 256 for dtypes torch lacks (``torch_npu.hifloat8`` 290, ``torch_npu.float8_e8m0fnu`` 293): :func:`resolve_dtype`."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import invalid, shape
from ..quant import Quant
from . import rules as checks
from .rules import platform_feature

SCALAR_TYPE_CODES = {
    0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
    15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn, 44: torch.float8_e8m0fnu,
    45: torch.float4_e2m1fn_x2,
}  # fmt: skip
SCALAR_TYPE_CODE = {dtype: code for code, dtype in SCALAR_TYPE_CODES.items()}  # a torch.dtype's code
ACL_CODES: dict[int, torch.dtype | str] = {  # ACL enum + 256: torch_npu's own dtype constants
    258: torch.int8, 285: "int4", 290: "hifloat8", 291: torch.float8_e5m2, 292: torch.float8_e4m3fn,
    293: torch.float8_e8m0fnu, 296: torch.float4_e2m1fn_x2, 297: "float4_e1m2fn_x2",
}  # fmt: skip
TORCH_NPU_CONSTANTS = {"int4": 285, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292, "float8_e8m0fnu": 293,
                       "float4_e2m1fn_x2": 296, "float4_e1m2fn_x2": 297}  # fmt: skip
"""The dtype constants ``torch_npu`` exports (as ints), by name."""


def resolve_dtype(value: object, param: str) -> torch.dtype | None:
    """``value`` (None, a ``torch.dtype`` or a torch_npu dtype code) as a ``torch.dtype`` (None stays None). Raises
    :class:`~deep_ep_npu.errors.MoeDistributeError` (161002) for a code that names no dtype, or one torch has no
    tensor type for (int4, hifloat8, float4_e1m2), naming ``param``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param, f"must be a torch.dtype or a torch_npu dtype code (int), got {type(value).__name__}")
    dtype: torch.dtype | str | None = SCALAR_TYPE_CODES.get(value) or ACL_CODES.get(value)
    if dtype is None:
        known = sorted({*SCALAR_TYPE_CODES, *ACL_CODES})
        raise invalid(param, f"dtype code {value} is not a dtype torch_npu's MoE ops take; known codes: {known}")
    if isinstance(dtype, str):
        raise invalid(param, f"dtype code {value} is torch_npu.{dtype}, which has no torch tensor type to compute with")
    return dtype


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
Y_DTYPES = {2: (torch.int8, *FP8), 3: FP8, 4: FP8, 5: FP8}  # quant_mode -> expand_x dtypes (y_dtype)


def hierarchy_rules(c: Any, x_param: str, hidden: int, mask: torch.Tensor | None) -> None:
    """comm_alg "hierarchy" (Atlas A3) of call ``c``: its documented requirements on every platform (no shared-expert
    ranks, zero / copy / const experts, 2D mask or performance_info; tp_world_size <= 1 is checked with the
    experts), its size limits under strict "a3" (W in [16, 256] a multiple of 16, H a multiple of 32, L <= 24,
    L * W <= 512; Bs <= 256 and H <= 7168 are checked with the tokens)."""
    if c.comm_alg != "hierarchy":
        return
    e = c.experts
    for name, value, ok in (
        ("shared_expert_rank_num", e.shared_expert_rank_num, not e.shared_expert_rank_num),
        ("zero_expert_num", e.zero_expert_num, not e.zero_expert_num),
        ("copy_expert_num", e.copy_expert_num, not e.copy_expert_num),
        ("const_expert_num", e.const_expert_num, not e.const_expert_num),
        ("x_active_mask", "a 2D mask", mask is None or mask.dim() == 1),
        ("performance_info", "a tensor", c.wait_stats is None),
    ):
        if not ok:
            why = "supports only tp_world_size <= 1, no shared-expert ranks, zero / copy / const experts"
            raise invalid(name, f"got {value!r}; comm_alg 'hierarchy' {why}, 2D x_active_mask or performance_info")
    if e.platform != "a3":
        return
    w, num_local = e.world_size, e.num_local
    if not 16 <= w <= 256 or w % 16:
        raise shape("ep_world_size", f"got {w}; comm_alg 'hierarchy' on Atlas A3 needs [16, 256], a multiple of 16")
    if hidden % 32:
        raise shape(f"{x_param}.shape[1] (H)", f"got {hidden}; comm_alg 'hierarchy' on Atlas A3 needs a multiple of 32")
    if num_local > 24 or num_local * w > 512:
        why = "comm_alg 'hierarchy' on Atlas A3 needs L <= 24 and L * W <= 512"
        raise shape("moe_expert_num", f"gives L = {num_local} local experts (L * W = {num_local * w}); {why}")


def dispatch_quant(
    quant_mode: object, y_dtype: object, x_dtype: object, scales_dtype: object, x: object, plat: str | None
) -> Quant | None:
    """``quant_mode`` with ``y_dtype`` / ``x_dtype`` / ``scales_dtype`` (torch dtypes or torch_npu codes) for ``x``:
    the :class:`Quant` to run, None for quant_mode 0."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else None
    mode = checks.in_range(quant_mode, "quant_mode", 0, 5, code="param")  # 0 none, 2 token, 3 per 128, 4 MX, 5 clip
    if mode == 1:
        why = "not implemented, its rounding and saturation are undocumented; allowed 0, 2, 3, 4 or 5"
        raise invalid("quant_mode", f"got 1 (static quant, Ascend 950): {why}")
    if mode >= 3:
        platform_feature(plat, "quant_mode", mode, ("a5",), "0 or 2")
    for name, value in (("y_dtype", y_dtype), ("x_dtype", x_dtype), ("scales_dtype", scales_dtype)):
        if value is not None:
            platform_feature(plat, name, value, ("a5",), "None")
    y = resolve_dtype(y_dtype, "y_dtype")
    given = repr(y_dtype) if y is y_dtype else f"{y_dtype!r} ({y})"
    if resolve_dtype(x_dtype, "x_dtype") not in (None, dtype):
        why = "(pre-quantized fp8 / hifloat8 / fp4 x) is not implemented; pass None or x's dtype"
        raise invalid("x_dtype", f"got {x_dtype!r} for an x of {dtype}: relabelling x's storage {why}")
    if resolve_dtype(scales_dtype, "scales_dtype") not in (None, torch.float32):
        why = "scales are float32 here (the e8m0 scales of a pre-quantized x are not implemented)"
        raise invalid("scales_dtype", f"got {scales_dtype!r}: {why}; pass None or torch.float32")
    if y == torch.float4_e2m1fn_x2:
        why = "fp4 output is not implemented (no fp4 compute here); use torch.float8_e4m3fn / torch.float8_e5m2"
        raise invalid("y_dtype", f"got {given}: {why}")
    if mode == 0:
        if y not in (None, dtype):
            why = f"quant_mode 0 keeps x's dtype {dtype} (hifloat8 output is not implemented): pass None"
            raise invalid("y_dtype", f"got {given}; {why}")
        return None
    y = torch.int8 if y is None and mode == 2 else y
    if y not in Y_DTYPES[mode]:
        codes = "(torch_npu codes: int8 1, float8_e5m2 23 / 291, float8_e4m3fn 24 / 292)"
        raise invalid("y_dtype", f"got {given}; quant_mode {mode} outputs {[str(d) for d in Y_DTYPES[mode]]} {codes}")
    return Quant(mode, y)
