"""torch_npu's dtype arguments and the platforms of ``strict`` mode.

torch_npu's MoE ops take dtypes as ``int?``: a ``torch.dtype`` becomes its ScalarType code (``torch.int8`` 1,
``torch.float8_e5m2`` 23, ``torch.float8_e4m3fn`` 24, ``torch.float8_e8m0fnu`` 44), and codes from 256 on are the ACL
dtype enum + 256, which is how torch_npu names dtypes torch lacks (``torch_npu.hifloat8`` 290) or spells twice
(``torch_npu.float8_e8m0fnu`` 293). :func:`resolve_dtype` turns either form into a ``torch.dtype``.

``strict`` (an argument of the ops): ``False`` checks only the rules every platform shares; ``True`` / ``"a3"`` adds
the Atlas A3 limits, ``"a5"`` the Ascend 950 (A5) ones. :func:`platform` normalizes it.
"""

from __future__ import annotations

import torch

from .errors import invalid

SCALAR_TYPE_CODES = {
    0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
    15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn, 44: torch.float8_e8m0fnu,
    45: torch.float4_e2m1fn_x2,
}  # fmt: skip
ACL_CODES: dict[int, torch.dtype | str] = {  # ACL enum + 256: torch_npu's own dtype constants
    258: torch.int8, 285: "int4", 290: "hifloat8", 291: torch.float8_e5m2, 292: torch.float8_e4m3fn,
    293: torch.float8_e8m0fnu, 296: torch.float4_e2m1fn_x2, 297: "float4_e1m2fn_x2",
}  # fmt: skip
TORCH_NPU_CONSTANTS = {"int4": 285, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292, "float8_e8m0fnu": 293,
                       "float4_e2m1fn_x2": 296, "float4_e1m2fn_x2": 297}  # fmt: skip
"""The dtype constants ``torch_npu`` exports (as ints), by name."""
SCALAR_TYPE_CODE = {dtype: code for code, dtype in SCALAR_TYPE_CODES.items()}
"""A ``torch.dtype``'s ScalarType code (the inverse of :data:`SCALAR_TYPE_CODES`)."""

PLATFORMS = {False: None, True: "a3", "a3": "a3", "a5": "a5"}
PLATFORM_NAMES = {"a2": "Atlas A2", "a3": "Atlas A3", "a5": "Ascend 950 (A5)"}  # a2: named in errors, not a strict


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


def platform(strict: object) -> str | None:
    """``strict`` as ``None`` (no platform limits), ``"a3"`` or ``"a5"``; anything else is a clear error."""
    if isinstance(strict, (bool, str)) and strict in PLATFORMS:
        return PLATFORMS[strict]
    raise invalid("strict", f"got {strict!r}; allowed False, True (= 'a3'), 'a3' (Atlas A3) or 'a5' (Ascend 950)")
