"""Builds the CPU kernels (``deep_ep_npu/kernels/_cpu.c``, ``loops.c``, ``expert_mm.c``, ``rms_norm.c``, ``attention.c``
and ``rope.c``) into the extension module ``deep_ep_npu.kernels._cpu`` when the package is installed (``pip install .``,
``pip install -e .``); the rest of the package is described in ``pyproject.toml``. The build needs a C compiler
(``$CC``, else the one Python was built with) and setuptools, nothing else: no torch headers. A failed build fails the
installation with the compiler's message; nothing is compiled at import or run time.

The flags keep the loops bit-identical to the torch code: no fused multiply-add (``-ffp-contract=off``), branch-free
selects that change no value (``-fno-trapping-math``). On x86 the vector loops get AVX-512 (x86-64-v4) clones
besides the AVX2 and baseline ones, picked at load time by the CPU; a compiler that lacks x86-64-v4 gets the AVX2 /
baseline build.
"""

from __future__ import annotations

import hashlib
import pathlib
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

KERNELS = pathlib.Path("deep_ep_npu/kernels")
SOURCES = [str(KERNELS / name) for name in ("_cpu.c", "loops.c", "expert_mm.c", "rms_norm.c", "attention.c", "rope.c")]
FLAGS = ["-O3", "-std=gnu11", "-fno-wrapv", "-ffp-contract=off", "-fno-trapping-math", "-fno-strict-aliasing"]


def sources_sha() -> str:
    """The hash of the kernels' C files, built into the module (``_cpu.SOURCES_SHA``): a stale build is told apart."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS.glob("*.[ch]")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class BuildKernels(build_ext):
    """``build_ext`` that first tries the AVX-512 clones on x86 (``-DDEP_X86_64_V4``), then builds without them."""

    def build_extension(self, ext: Extension) -> None:
        if platform.machine() in ("x86_64", "AMD64"):
            base = ext.extra_compile_args
            ext.extra_compile_args = [*base, "-DDEP_X86_64_V4"]
            try:
                super().build_extension(ext)
                return
            except CompileError:
                print("deep_ep_npu: this compiler lacks x86-64-v4; building the AVX2 / baseline kernels")
            finally:
                ext.extra_compile_args = base
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "deep_ep_npu.kernels._cpu",
            sources=SOURCES,
            depends=[str(KERNELS / "loops.h")],
            extra_compile_args=FLAGS,
            define_macros=[("DEP_SOURCES_SHA", f'"{sources_sha()}"')],
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
