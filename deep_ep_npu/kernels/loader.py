"""Loading the CPU kernels' extension module (``_cpu``, built when the package is installed) and turning them off.

``DEEP_EP_NPU_CPU_KERNELS=0`` turns the kernels off; :func:`disabled` does for a block; :func:`unavailable` says
why they are off. When the extension is missing (an installation that did not build it), the first CPU call that
would have used it warns, once per process, and the torch code runs: never a silent slowdown.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Iterator
from types import ModuleType

from .. import envs

_EXTENSION = f"{__package__}._cpu"

try:
    _built: ModuleType | None = importlib.import_module(_EXTENSION)
    _missing = ""
except ImportError as err:
    _built = None
    _missing = f"the extension {_EXTENSION} is not built ({err}); reinstall the package: pip install ."
_enabled = [True]  # (disabled() sets it off)
_warned = [False]


@functools.cache
def _turned_on() -> bool:
    return envs.cpu_kernels()  # (read once per process)


def library() -> ModuleType | None:
    """The built kernels, or None when they are off or missing (the first call that finds them missing warns)."""
    if not _enabled[0] or not _turned_on():
        return None
    if _built is None and not _warned[0]:
        _warned[0] = True
        warnings.warn(f"deep_ep_npu: CPU tensors take the slower torch code: {_missing}", RuntimeWarning, stacklevel=3)
    return _built


def unavailable() -> str:
    """ "" when the kernels are in use, else why not."""
    if not _turned_on():
        return "DEEP_EP_NPU_CPU_KERNELS=0"
    return _missing or ("" if _enabled[0] else "turned off by kernels.disabled()")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch code paths instead of the kernels inside this block (this process)."""
    before, _enabled[0] = _enabled[0], False
    try:
        yield
    finally:
        _enabled[0] = before
