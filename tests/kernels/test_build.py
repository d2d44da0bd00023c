"""The CPU kernels are built when the package is installed (``setup.py``) and only loaded at run time: they load with
no compiler on ``PATH``; the install-time build falls back to AVX2 / baseline on a compiler without x86-64-v4 and
fails with the compiler's message on a broken one; a missing extension warns once and leaves the torch code.
Each case runs in a fresh interpreter."""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

from deep_ep_npu import kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fresh(code: str, env: dict[str, str] | None = None) -> str:
    """What ``code`` prints in a fresh interpreter (in the repository root, with ``env`` as its environment)."""
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=os.environ if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_variable_turns_them_off():
    code = "from deep_ep_npu import kernels; print(repr(kernels.unavailable()), kernels.library())"
    assert _fresh(code, {**os.environ, "DEEP_EP_NPU_CPU_KERNELS": "0"}) == "'DEEP_EP_NPU_CPU_KERNELS=0' None"


def test_they_load_with_no_compiler_on_path(tmp_path):
    """Nothing compiles at import or run time: with only ``python`` on ``PATH`` and no ``CC``, the kernels load."""
    (tmp_path / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LDSHARED")} | {"PATH": str(tmp_path)}
    code = """import shutil, torch
from deep_ep_npu import kernels
assert not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), "a compiler is on PATH"
print(repr(kernels.unavailable()), kernels.to_e4m3(torch.tensor([1.0, -448.0])).tolist())"""
    assert _fresh(code, env) == "'' [56, 254]"


def test_a_missing_extension_warns_once_and_runs_torch():
    """An install without the extension (simulated: its import fails): the first CPU call that would have used the
    kernels warns once, naming why; every call runs the torch code; calls on other devices do not warn."""
    code = """import sys, warnings, torch
sys.modules["deep_ep_npu.kernels._cpu"] = None  # its import raises ImportError, as where it was never built
from deep_ep_npu import kernels
from deep_ep_npu.engine.plan import plan_topk
ids, mask = torch.tensor([[0, 3], [2, -1]]), torch.zeros(2, dtype=torch.int32)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert kernels.to_e4m3(torch.ones(2, device="meta")) is None and not seen  # not a CPU tensor: no warning
    assert kernels.to_e4m3(torch.ones(2)) is None and kernels.ids_ok(ids, -1, 4) is None
    fallback = plan_topk(ids, num_local_experts=2, num_ranks=2, rank=0, mask=mask, per_pair_rows=False)
print(len(seen), seen[0].category.__name__, "|", seen[0].message)
print(kernels.unavailable())
print(fallback.row_token.tolist(), fallback.dest.tolist())"""
    lines = _fresh(code).splitlines()
    assert lines[0].startswith("1 RuntimeWarning | deep_ep_npu: CPU tensors take the slower torch code"), lines
    assert "deep_ep_npu.kernels._cpu is not built" in lines[0] and "pip install" in lines[0]
    assert lines[1].startswith("the extension deep_ep_npu.kernels._cpu is not built"), lines
    assert lines[2] == "[0, 1, 0] [0, 1, 1]"  # (remote rows first, then this rank's)


def test_the_build_is_of_these_sources():
    """The loaded extension was built from the C files in the tree (``setup.py`` builds their hash in)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "deep_ep_npu" / "kernels").glob("*.[ch]")):
        digest.update(path.read_bytes())
    lib = kernels.library()
    assert lib is not None, kernels.unavailable()
    want = digest.hexdigest()[:16]
    assert want == lib.SOURCES_SHA, "a stale build: rerun `pip install -e .` after editing the C files"


def _build(tmp_path: pathlib.Path, cc: str) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` (what installing runs) with ``cc`` as the compiler, into ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k != "LDSHARED"} | {"CC": cc}
    cmd = [
        sys.executable,
        "setup.py",
        "build_ext",
        "--build-lib",
        str(tmp_path / "lib"),
        "--build-temp",
        str(tmp_path / "tmp"),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _fake_cc(tmp_path: pathlib.Path, refuse: str) -> str:
    """A compiler that prints an error and fails when its arguments match the shell pattern ``refuse``, else gcc."""
    real = shutil.which("gcc") or shutil.which("cc")
    assert real is not None
    cc = tmp_path / "fake_cc"
    cc.write_text(
        f'#!/bin/sh\ncase "$*" in {refuse}) echo "fake_cc: error: refused" >&2; exit 1;; esac\nexec {real} "$@"\n'
    )
    cc.chmod(0o755)
    return str(cc)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX-512 clones are x86 only")
def test_the_install_build_falls_back_without_x86_64_v4(tmp_path):
    run = _build(tmp_path, _fake_cc(tmp_path, "*DEP_X86_64_V4*"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "this compiler lacks x86-64-v4" in run.stdout
    (built,) = (tmp_path / "lib").rglob("_cpu*.so")
    code = f"""import importlib.util, torch
spec = importlib.util.spec_from_file_location("deep_ep_npu.kernels._cpu", {str(built)!r})
lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lib)
out = torch.zeros(2, dtype=torch.uint8)
lib.to_e4m3(torch.tensor([1.0, -448.0]), 2, out)
print(out.tolist())"""
    assert _fresh(code) == "[56, 254]"


def test_a_failed_build_fails_the_install_with_the_compilers_message(tmp_path):
    run = _build(tmp_path, _fake_cc(tmp_path, "*"))
    assert run.returncode != 0 and "fake_cc: error: refused" in run.stderr + run.stdout
    assert not list((tmp_path / "lib").rglob("_cpu*.so"))
