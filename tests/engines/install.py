"""Installs the engines' released packages for tests/engines (``python -m tests.engines.install [NAME ...]``;
scripts/test.sh runs it before pytest).

Each engine gets a folder of its own outside the repository, ``~/.cache/deep_ep_npu/engines/NAME-HASH`` (HASH: the
pinned list ``requirements/NAME.txt``), filled by ``pip install --no-deps --target`` from that list and found on
``sys.path`` only by the rank processes that test it: the engines' own dependency pins (CUDA packages, torch 2.14,
torch 2.10) never touch .venv, and a second run finds the folder and costs nothing (pip's download cache serves a
fresh folder). A failed install leaves ``NAME-HASH.error`` with pip's output; the tests skip with it as the reason."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "deep_ep_npu" / "engines"
ENGINES = ("vllm", "sglang", "vllm_ascend")
BUILD_INFO = "__device_type__ = 'A3'\n"  # what vllm-ascend's setup.py generates for an A3 build


def requirements(name: str) -> Path:
    return HERE / "requirements" / f"{name}.txt"


def folder(name: str) -> Path:
    """Where engine ``name`` is (or will be) installed."""
    digest = hashlib.sha256(requirements(name).read_bytes()).hexdigest()[:12]
    return CACHE / f"{name}-{digest}"


def error_file(name: str) -> Path:
    return folder(name).with_suffix(".error")


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def _unpack_sdist(spec: str, target: Path) -> str:
    """Put the package folder of sdist ``spec`` (``name==version``) into ``target``; an error text or "".

    pip prepares an sdist's metadata even to download it: vllm-ascend's needs ``setuptools_scm`` (installed beside
    it in a scratch folder, no build isolation) and ``SOC_VERSION``."""
    import os
    import tarfile

    with tempfile.TemporaryDirectory() as scratch:
        tools = Path(scratch) / "tools"
        done = _pip("install", "--target", str(tools), "setuptools_scm==9.2.2", "setuptools==80.9.0")
        if done.returncode == 0:
            env = dict(os.environ, PYTHONPATH=str(tools), SOC_VERSION="ascend910_9391")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "--disable-pip-version-check",
                "-q",
                "download",
                "--no-deps",
                "--no-build-isolation",
                "--no-binary",
                ":all:",
                "-d",
                scratch,
                spec,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            return f"pip download {spec} failed:\n{done.stderr[-4000:]}"
        (archive,) = Path(scratch).glob("*.tar.gz")
        package = spec.split("==")[0].replace("-", "_")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == [package]]
            for m in members:
                m.name = m.name.split("/", 1)[1]
            tar.extractall(target, members=members, filter="data")
        (target / package / "_build_info.py").write_text(BUILD_INFO)
    return ""


def install(name: str) -> bool:
    """Install engine ``name`` unless it is; True when it is installed."""
    target = folder(name)
    if (target / ".complete").exists():
        return True
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=CACHE))
    done = _pip("install", "--no-deps", "--target", str(staging), "-r", str(requirements(name)))
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        error_file(name).write_text(f"pip install -r {requirements(name).name} failed:\n{done.stderr[-4000:]}")
        return False
    sdists = [
        line.split(":", 1)[1].strip()
        for line in requirements(name).read_text().splitlines()
        if line.startswith("# sdist:")
    ]
    for spec in sdists:
        why = _unpack_sdist(spec, staging)
        if why:
            shutil.rmtree(staging, ignore_errors=True)
            error_file(name).write_text(why)
            return False
    (staging / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    error_file(name).unlink(missing_ok=True)
    return True


def main(names: list[str]) -> int:
    for name in names or ENGINES:
        ok = install(name)
        print(f"engines: {name} {'in ' + str(folder(name)) if ok else 'NOT installed: ' + str(error_file(name))}")
    return 0  # a failed install skips its tests (with the reason), it does not stop the suite


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
