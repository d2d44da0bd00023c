"""One of vllm-ascend's own ops (``torch.ops._C_ascend``) that the stand-in defines with a CPU kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CustomOp:
    """``torch.ops._C_ascend.<name>`` with ``schema`` (vllm-ascend's, ``name(...) -> ...``) and its CPU ``kernel``."""

    def __init__(self, schema: str, kernel: Callable[..., object]) -> None:
        self.schema, self.kernel, self.name = schema, kernel, schema.split("(", 1)[0]
        self._libs: list[torch.library.Library] = []

    def register(self) -> None:
        """Define the op (idempotent). Raises RuntimeError when another library (e.g. vllm-ascend's real custom ops)
        already defines it."""
        if self._libs:
            return
        lib = torch.library.Library("_C_ascend", "FRAGMENT")
        try:
            lib.define(self.schema)
            lib.impl(self.name, self.kernel, "CPU")
        except RuntimeError as err:
            lib._destroy()
            why = f"cannot register _C_ascend::{self.name} (already defined?): {err}"
            raise RuntimeError(f"deep_ep_npu.sim: {why}") from err
        self._libs.append(lib)

    def unregister(self) -> None:
        """Remove what :meth:`register` defined (idempotent); :meth:`register` works again afterwards."""
        while self._libs:
            self._libs.pop()._destroy()

    def registered(self) -> bool:
        return bool(self._libs)
