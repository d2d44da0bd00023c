"""Backend registry for :class:`deep_ep_npu.Buffer`: ``"reference"`` (torch.distributed), ``"ascend"`` (NPU ops).

Backends are registered by name with the import path of their class, so importing this package never imports a
backend's dependencies (``torch_npu`` is imported only when the Ascend backend is created).
"""

from __future__ import annotations

import importlib
import importlib.util

from .base import BufferConfig, LowLatencyBackend

_REGISTRY: dict[str, str] = {
    "reference": "deep_ep_npu.backends.reference:ReferenceBackend",
    "ascend": "deep_ep_npu.backends.ascend:AscendBackend",
}


def register_backend(name: str, target: str | type[LowLatencyBackend]) -> None:
    """Register a backend class (or ``"module:Class"`` path) under ``name``; later registrations replace earlier."""
    _REGISTRY[name] = target  # type: ignore[assignment]


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def npu_available() -> bool:
    """True when torch_npu is installed and reports an NPU (imports torch_npu only if it is installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    import torch

    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_backend_name(name: str) -> str:
    """``"auto"`` is ``"ascend"`` when torch_npu and an NPU are present, else ``"reference"``."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}; known: {['auto', *available_backends()]}")
    if name == "auto":
        return "ascend" if npu_available() else "reference"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {['auto', *available_backends()]}")
    return name


def create_backend(name: str, group, config: BufferConfig) -> LowLatencyBackend:
    """Build the backend registered as ``name`` (after resolving ``"auto"``)."""
    target = _REGISTRY[resolve_backend_name(name)]
    if isinstance(target, str):
        module_name, _, cls_name = target.partition(":")
        target = getattr(importlib.import_module(module_name), cls_name)
    return target(group, config)


__all__ = [
    "BufferConfig",
    "LowLatencyBackend",
    "available_backends",
    "create_backend",
    "register_backend",
    "resolve_backend_name",
]
