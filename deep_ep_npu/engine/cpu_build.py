"""Building and loading the engine's CPU kernels (``cpu_kernels.c``; their Python side: :mod:`.cpu_kernels`).

The C file is compiled once per machine with the system C compiler (``cc``, or ``$CC``) into a cache directory
(``$DEEP_EP_NPU_CACHE``, else ``$XDG_CACHE_HOME/deep_ep_npu``, else ``~/.cache/deep_ep_npu``; named by a hash of
the source, the flags and the machine, written atomically so that ranks compiling at once do not clash) and loaded
with :mod:`ctypes`. On x86 the build first tries AVX-512 (x86-64-v4) clones of the vector loops besides the AVX2
and baseline ones, and without them on a compiler that lacks x86-64-v4. ``DEEP_EP_NPU_CPU_KERNELS=0`` turns the
kernels off; :func:`unavailable` says why they are off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator

import torch

from .. import envs

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.c")
_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-trapping-math", "-fno-strict-aliasing"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The C side's dtype codes."""
_i64, _p = ctypes.c_int64, ctypes.c_void_p

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "why": why not
_enabled = [True]


def _cache_dir() -> str:
    if path := envs.cache_dir():
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deep_ep_npu")


def _compile(cc: str, flags: list[str], source: bytes) -> tuple[str | None, str]:
    """The library built with ``flags`` (from the cache when it is there): its path, or None and why not."""
    key = hashlib.sha256(source + " ".join([cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"cpu_kernels_{key}.so")
    if os.path.exists(path):
        return path, ""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            run = subprocess.run([cc, *flags, _SOURCE, "-o", tmp], capture_output=True, text=True, timeout=120)
            if run.returncode:
                return None, f"{cc} failed: {run.stderr.strip()[:500]}"
            os.replace(tmp, path)  # atomic: a rank that compiles at the same time replaces an identical file
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # (gone already once replaced)
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"could not build {path}: {err}"
    return path, ""


def _build() -> tuple[ctypes.CDLL | None, str]:
    if not envs.cpu_kernels():
        return None, "DEEP_EP_NPU_CPU_KERNELS=0"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) found"
    with open(_SOURCE, "rb") as f:
        source = f.read()
    path, why = None, ""
    if platform.machine() in ("x86_64", "AMD64"):  # AVX-512 clones too, where the compiler knows x86-64-v4
        path, why = _compile(cc, [*_FLAGS, "-DDEP_X86_64_V4"], source)
    if path is None:
        path, why = _compile(cc, _FLAGS, source)
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        return None, f"could not load {path}: {err}"
    lib.dep_accumulate.restype = ctypes.c_int
    lib.dep_accumulate.argtypes = [_p, _i64, _i64, _p, _i64, ctypes.c_int, _p, _p, _p, _p, _i64, ctypes.c_int]
    lib.dep_place.restype = _i64
    lib.dep_place.argtypes = [_p, *[_i64] * 10, _p, _p, _p, _p, _p, _p]
    lib.dep_has_dtype.restype = ctypes.c_int
    lib.dep_has_dtype.argtypes = [ctypes.c_int]
    lib.dep_check_ids.restype = ctypes.c_int
    lib.dep_check_ids.argtypes = [_p, _i64, _i64, _i64, _i64]
    lib.dep_plan.restype = _i64
    lib.dep_plan.argtypes = [_p, *[_i64] * 5, _p, ctypes.c_int, *[_p] * 11]
    lib.dep_pack.restype = None
    lib.dep_pack.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _i64, ctypes.c_int]
    lib.dep_place_pairs.restype = ctypes.c_int
    lib.dep_place_pairs.argtypes = [_p, _i64, _p, _p, *[_i64] * 5, _p, _p, _p, _p]
    lib.dep_layout_range.restype = None
    lib.dep_layout_range.argtypes = [_p, _i64, _i64, _i64, _p, _p]
    lib.dep_return_rows.restype = _i64
    lib.dep_return_rows.argtypes = [_p, _i64, _i64, _i64, _p, _p, _p]
    lib.dep_place_flat.restype = _i64
    lib.dep_place_flat.argtypes = [_p, _p, _p, *[_i64] * 12, _p, _p, _p, _p, _p]
    lib.dep_pack_int8.restype = ctypes.c_int
    lib.dep_pack_int8.argtypes = [_p, ctypes.c_int, _i64, _p, _p, _p, _i64, _i64, _p, *[_i64] * 5]
    lib.dep_place_scales.restype = None
    lib.dep_place_scales.argtypes = [_p, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, ctypes.c_int]
    lib.dep_pack_fp8.restype = ctypes.c_int
    lib.dep_pack_fp8.argtypes = [_p, ctypes.c_int, _i64, _p, _p, _i64, _i64, _p, *[_i64] * 4]
    lib.dep_to_e4m3.restype = None
    lib.dep_to_e4m3.argtypes = [_p, _i64, _p]
    lib.dep_gather.restype = None
    lib.dep_gather.argtypes = [_p, _i64, _p, _i64, _p]
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first use), or None when they are off or cannot be built."""
    if not _enabled[0]:
        return None
    if "lib" not in _state:  # (built once; later calls take no lock)
        with _lock:
            if "lib" not in _state:
                lib, _state["why"] = _build()
                _state["lib"] = lib  # last: another thread that sees "lib" sees "why" too
    return _state["lib"]  # type: ignore[return-value]


def unavailable() -> str:
    """ "" when the kernels are in use, else why not."""
    return "" if library() is not None else str(_state.get("why", "turned off by cpu_kernels.disabled()"))


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch code paths instead of the kernels inside this block (this process)."""
    before, _enabled[0] = _enabled[0], False
    try:
        yield
    finally:
        _enabled[0] = before
