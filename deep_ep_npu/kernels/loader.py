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
    built: ModuleType | None = importlib.import_module(_EXTENSION)
    _missing = ""
except ImportError as err:
    built = None
    _missing = f"the extension {_EXTENSION} is not built ({err}); reinstall the package: pip install ."
enabled = [True]  # (disabled() sets it off)
_warned = [False]


@functools.cache
def turned_on() -> bool:
    return envs.cpu_kernels()  # (read once per process)


def missing() -> None:
    """The kernels are missing: warn, the first time in this process (the torch code runs)."""
    if not _warned[0]:
        _warned[0] = True
        warnings.warn(f"deep_ep_npu: CPU tensors take the slower torch code: {_missing}", RuntimeWarning, stacklevel=4)


def unavailable() -> str:
    """ "" when the kernels are in use, else why not."""
    if not turned_on():
        return "DEEP_EP_NPU_CPU_KERNELS=0"
    return _missing or ("" if enabled[0] else "turned off by kernels.disabled()")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch code paths instead of the kernels inside this block (this process)."""
    before, enabled[0] = enabled[0], False
    try:
        yield
    finally:
        enabled[0] = before
