"""Integer ``torch.histc``, as torch_npu's kernel has it and CPU torch's lacks (``"histogram_cpu" not implemented for
'Int'``): engines count tokens per expert with ``torch.histc(topk_ids, bins=E, min=0, max=E)`` on int32 / int64
expert ids (vllm-ascend's All2AllV dispatcher). While the stand-in is installed, ``torch.histc`` and
``Tensor.histc`` on an integer tensor count in float64 and return the counts in the input's dtype (exact below
2**53 elements); floating-point calls are torch's own."""

from __future__ import annotations

from typing import Any

import torch

_original: dict[str, Any] = {}


def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *, out: Any = None) -> torch.Tensor:
    """``torch.histc(input [N...] any dtype, bins, min, max)`` -> [bins] counts in ``input.dtype``."""
    original = _original.get("torch", torch.histc)
    if input.is_floating_point() or input.is_complex() or input.dtype == torch.bool:
        return original(input, bins, min, max, out=out) if out is not None else original(input, bins, min, max)
    counts = original(input.double(), bins, min, max).to(input.dtype)
    return out.copy_(counts) if out is not None else counts


def _method(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    return histc(self, bins, min, max)


def install() -> None:
    """Route ``torch.histc`` / ``Tensor.histc`` through :func:`histc` (idempotent)."""
    if not _original:
        _original.update(torch=torch.histc, tensor=torch.Tensor.histc)
        torch.histc = histc  # type: ignore[assignment]
        torch.Tensor.histc = _method  # type: ignore[method-assign, assignment]


def uninstall() -> None:
    """Restore torch's own ``histc`` (idempotent)."""
    if _original:
        torch.histc = _original.pop("torch")  # type: ignore[assignment]
        torch.Tensor.histc = _original.pop("tensor")  # type: ignore[method-assign]
