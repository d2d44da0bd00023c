"""Shared by the engine tests: where an engine is installed (skip with the installer's reason if it is not), putting
it on a rank's ``sys.path`` with ``import deep_ep`` answered by this library, and the independent reference: a dense
single-process MoE in plain torch over the same tokens, routing and experts."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

import pytest
import torch

from . import install


def require(name: str) -> str:
    """The folder engine ``name`` is installed in; skips the test (with the installer's reason) when it is not."""
    target = install.folder(name)
    if (target / ".complete").exists():
        return str(target)
    error = install.error_file(name)
    why = error.read_text() if error.exists() else "not installed: run `python -m tests.engines.install` (test.sh does)"
    pytest.skip(f"{name} ({install.requirements(name).name}): {why}")


def enter(path: str) -> None:
    """In a rank process: the engine's folder first on ``sys.path``, ``import deep_ep`` giving this library."""
    import deep_ep_npu.alias

    sys.path.insert(0, path)
    assert deep_ep_npu.alias.install(), "a real DeepEP is installed: the engine would not run on this library"


class _Anything:
    """What a stubbed module's attributes are: callable, subscriptable, with any attribute (class and instance)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __class_getitem__(cls, item: object) -> type:
        return cls


class _StubModule(ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's protocol
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []


def stub_packages(*roots: str) -> None:
    """Make ``import ROOT[.anything]`` give empty stand-in modules (for packages an engine imports at module level
    in code the test never runs, e.g. a CUDA build that cannot load beside CPU torch)."""
    sys.meta_path.insert(0, _StubFinder(set(roots)))


# ---- the independent reference ---------------------------------------------------------------------------------


def expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of the test MoE: ``silu(x * a_e)`` with a per-expert random ``a_e`` [H]; x [n, H] bf16 ->
    [n, H] bf16 (computed in fp32)."""
    g = torch.Generator().manual_seed(1000 + e)
    a = torch.randn(x.shape[-1], generator=g)
    return torch.nn.functional.silu(x.float() * a).to(torch.bfloat16)


def tokens(rank: int, n: int, hidden: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens x [n, hidden] bf16, top-k expert ids [n, k] int64 (distinct per token), weights [n, k]
    fp32."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).long()
    return x, ids, torch.rand((n, k), generator=g)


def fp8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [n, H] bf16 as DeepEP's fp8 dispatch carries it, dequantized: per token and 128 channels ``s = max(amax,
    1e-4) / 448``, ``q = e4m3(x / s)``, returned as ``q * s`` in bf16 [n, H]."""
    blocks = x.float().view(x.shape[0], -1, 128)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448
    q = (blocks / scale).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(x.shape).to(torch.bfloat16)


def per_token(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [n, H] bf16 as a per-token dynamic quantization into ``dtype`` (torch.int8 or torch.float8_e4m3fn) carries it,
    dequantized: per token ``s = amax / maxV`` (127 or 448), ``q = rint(x / s)`` (int8) or ``e4m3(x / s)``, returned
    as ``q * s`` in bf16 [n, H]."""
    xf = x.float()
    vmax = torch.full((x.shape[0], 1), 127.0 if dtype == torch.int8 else 448.0)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    q = xf * (vmax / amax)
    q = torch.round(q).clamp(-127, 127) if dtype == torch.int8 else q.to(dtype).float()
    return (q * (amax / vmax)).to(torch.bfloat16)


def mx_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [n, H] bf16 (H a multiple of 32) as MX fp8 (e4m3) carries it, dequantized: per 32 elements a power-of-two
    scale ``2^(floor(log2 amax) - 8)`` (8: e4m3's largest exponent), ``q = e4m3(x / scale)``; bf16 [n, H]."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(dim=-1, keepdim=True))) - 8)
    return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).view(x.shape).to(torch.bfloat16)


def dense_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, owners: int = 1, experts: int = 0, returned=None
):
    """sum_k weights[t, k] * expert(ids[t, k], x[t]) for each token, in fp32, returned as bf16 [n, H].

    ``owners`` > 1 models a per-rank reduction before the cross-rank sum (DeepEP's normal-mode combine of outputs
    the experts' ranks already weighted and summed): the terms of the ``experts // owners`` experts each rank owns
    are summed and rounded to bf16 first. ``returned``: what the way back does to an expert's output row ([1, H] bf16
    -> [1, H] bf16, e.g. :func:`mx_blocks` for a quantized combine), or None."""
    per_owner = max(experts // owners, 1)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for owner in range(owners):
        part = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for slot in range(ids.shape[1]):
                e = int(ids[t, slot])
                if owners == 1 or e // per_owner == owner:
                    y = expert(e, x[t : t + 1])
                    part[t] += weights[t, slot] * (y if returned is None else returned(y))[0].float()
        out += part if owners == 1 else part.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within one bf16 rounding (a wrong route or weight is off by O(1))."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7, msg=lambda m: f"{what}: {m}")
