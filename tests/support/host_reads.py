"""Host reads of tensor values, attributed to the code that made them: ``with HostReads(device=...) as reads:`` patches
every torch entry point that copies a tensor's values to the host (a device-to-host sync on a GPU / NPU, and an
error inside a graph capture) and records, for each call made while the innermost ``deep_ep_npu`` frame on the stack
is library code, that frame as ``"path:line function (what)"``. Calls whose stack passes through one of the
``device`` path prefixes (relative to the package, e.g. ``"ops/"``: the NPU stand-in's op standing for a device
kernel) are not library reads, nor are calls made from tests only; a task that device code hands to a thread pool
(``ThreadPoolExecutor.submit``) is device code too.

Patched: ``Tensor.item`` / ``tolist`` / ``numpy`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` /
``__format__`` / ``nonzero`` / ``unique`` / ``masked_select``, ``torch.nonzero`` / ``unique`` / ``masked_select`` /
``equal`` / ``allclose`` / ``bincount`` / ``argwhere`` / ``unique_consecutive``, ``torch.repeat_interleave``
without ``output_size``, and indexing (``t[...]``, ``t[...] = v``) with a boolean tensor: each sizes its output by
the values (or returns them to Python)."""

from __future__ import annotations

import concurrent.futures
import functools
import pathlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

import deep_ep_npu

LIB = str(pathlib.Path(deep_ep_npu.__file__).parent) + "/"
_TENSOR = (
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "nonzero",
    "unique",
    "masked_select",
)
_TORCH = ("nonzero", "unique", "masked_select", "equal", "allclose", "bincount", "argwhere", "unique_consecutive")


_THREAD = threading.local()  # .device: this thread runs a task that device code submitted


def _sized_by_values(*args: Any, **kwargs: Any) -> bool:
    """``repeat_interleave``'s output size comes from its repeats' values unless ``output_size`` is given."""
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return kwargs.get("output_size") is None and (repeats is None or isinstance(repeats, torch.Tensor))


def _bool_index(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(list[str]):
    """The library's host reads while active (see the module docstring); ``device``: package-relative path prefixes
    whose frames stand for device code."""

    def __init__(self, device: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.device = tuple(LIB + d for d in device)
        self._saved: list[tuple[Any, str, Any]] = []

    def _where(self) -> str | None:
        """The innermost library frame of the current stack, or None (not library code, or inside ``device``)."""
        frame, found = sys._getframe(2), None
        if getattr(_THREAD, "device", False):
            return None
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(self.device):
                return None
            if found is None and path.startswith(LIB):
                found = f"{path[len(LIB) :]}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return found

    def _patch(self, owner: Any, name: str, needs: Callable[..., bool] | None = None) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def spy(*args: Any, **kwargs: Any) -> Any:
            if (needs is None or needs(*args, **kwargs)) and (where := self._where()) is not None:
                self.append(f"{where} ({name})")
            return real(*args, **kwargs)

        self._saved.append((owner, name, real))
        setattr(owner, name, spy)

    def _patch_pool(self) -> None:
        """Tasks submitted from device code run as device code (their thread's stack does not show it)."""
        real = concurrent.futures.ThreadPoolExecutor.submit

        def submit(pool: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            device = self._under_device()

            def run(*a: Any, **kw: Any) -> Any:
                _THREAD.device = device
                try:
                    return fn(*a, **kw)
                finally:
                    _THREAD.device = False

            return real(pool, run, *args, **kwargs)

        self._saved.append((concurrent.futures.ThreadPoolExecutor, "submit", real))
        concurrent.futures.ThreadPoolExecutor.submit = submit  # type: ignore[method-assign]

    def _under_device(self) -> bool:
        """Whether the caller runs inside ``device`` code."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.device):
                return True
            frame = frame.f_back
        return bool(getattr(_THREAD, "device", False))

    def __enter__(self) -> HostReads:
        self._patch_pool()
        for name in _TENSOR:
            self._patch(torch.Tensor, name)
        for name in _TORCH:
            self._patch(torch, name)
        self._patch(torch, "repeat_interleave", _sized_by_values)
        self._patch(torch.Tensor, "repeat_interleave", _sized_by_values)
        self._patch(torch.Tensor, "__getitem__", lambda _, index: _bool_index(index))
        self._patch(torch.Tensor, "__setitem__", lambda _, index, value: _bool_index(index))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()
