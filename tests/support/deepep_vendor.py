"""Runs DeepEP's own tests (``tests/vendor/deepep``: verbatim copies, MIT, see its README) on ``deep_ep_npu`` in one
rank process: ``import deep_ep`` is this library (:func:`deep_ep_npu.alias.install`), ``deep_ep.utils.{envs, math,
testing}`` are the helpers below (written anew from what DeepEP's helpers do; CPU timers instead of CUDA events and
kineto), and ``device='cuda'`` in the tests' tensor factories means the CPU (:class:`CudaIsCpu`). The process group
is the launcher's (``init_dist`` returns it; the test's ``destroy_process_group`` is left to the launcher).

Only DeepEP's hardware constant changes, as text, when a module is loaded: its internode test asserts 8 ranks per
node (``num_local_ranks == 8``, ``num_ranks > 8``); on simulated hosts of G ranks these read G (:func:`load`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.support.deepep_utils import calc_diff, hash_tensor, per_token_cast_back

VENDOR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vendor", "deepep")


class CudaIsCpu(TorchFunctionMode):
    """``device='cuda'`` (or ``cuda:i``) given to any torch function means the CPU."""

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel e4m3 cast: (data `[m, n]`, scales ``amax / 448`` `[m, n / 128]` fp32)."""
    m, n = x.shape
    amax = x.float().view(m, n // 128, 128).abs().amax(dim=2).clamp(min=1e-4)
    data = (x.float().view(m, n // 128, 128) * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn)
    return data.view(m, n), (amax / 448.0).view(m, -1)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row of ``x`` (values in ``[0, num_slots)`` or -1) becomes its distinct values, descending, then -1."""
    rows = []
    for row in x.tolist():
        kept = sorted({v for v in row if v >= 0}, reverse=True)[: x.shape[1]]
        rows.append(kept + [-1] * (x.shape[1] - len(kept)))
    x.copy_(torch.tensor(rows, dtype=x.dtype).view(x.shape))


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``scores`` `[T, E]` with the experts outside each token's chosen groups (``group_idx`` `[T, k]`) zeroed."""
    t, e = scores.shape
    mask = torch.zeros((t, num_groups), dtype=torch.bool).scatter_(1, group_idx, True)
    return (scores.view(t, num_groups, -1) * mask.unsqueeze(-1)).view(t, e)


def bench(fn: Any, num_warmups: int = 50, num_tests: int = 50, post_fn: Any = None, **_: Any) -> tuple:
    """(average, min, max) seconds of two timed runs of ``fn`` (CPU clock)."""
    times = []
    for _i in range(2):
        start = time.perf_counter()
        fn()
        if post_fn is not None:
            post_fn()
        times.append(time.perf_counter() - start)
    return sum(times) / len(times), min(times), max(times)


def bench_kineto(fn: Any, kernel_names: Any, num_tests: int = 30, num_kernels_per_period: int = 1, **_: Any) -> Any:
    """One timed run of ``fn`` reported for every name (no per-kernel profile on the CPU), per kernel of a period
    (DeepEP's: a tuple per name when a period has several kernels)."""
    t = bench(fn)[0]
    t = t if num_kernels_per_period == 1 else (t,) * num_kernels_per_period
    return tuple(t for _ in kernel_names) if isinstance(kernel_names, tuple) else t


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def install(group: dist.ProcessGroup) -> None:
    """``deep_ep`` and its ``utils`` helpers for DeepEP's test modules, in this process."""
    from deep_ep_npu import alias

    assert alias.install(), "a real deep_ep is installed: these runs are meant for deep_ep_npu"
    import deep_ep  # noqa: F401 - (the alias, now in sys.modules)

    def init_dist(local_rank: int, num_local_ranks: int) -> tuple[int, int, dist.ProcessGroup]:
        torch.set_default_dtype(torch.bfloat16)
        return dist.get_rank(), dist.get_world_size(), group

    _module("deep_ep.utils.envs", init_dist=init_dist)
    _module(
        "deep_ep.utils.math",
        calc_diff=calc_diff,
        per_token_cast_back=per_token_cast_back,
        per_token_cast_to_fp8=per_token_cast_to_fp8,
        inplace_unique=inplace_unique,
        hash_tensor=hash_tensor,
        create_grouped_scores=create_grouped_scores,
    )
    _module("deep_ep.utils.testing", bench=bench, bench_kineto=bench_kineto)


def load(name: str, ranks_per_node: int = 8) -> types.ModuleType:
    """DeepEP's test module ``name`` from the vendored copy (its 8 ranks per node read ``ranks_per_node``)."""
    with open(os.path.join(VENDOR, f"{name}.py"), encoding="utf-8") as f:
        source = f.read()
    if name == "test_internode" and ranks_per_node != 8:
        subs = (
            ("num_local_ranks == 8", f"num_local_ranks == {ranks_per_node}"),
            ("num_ranks > 8", f"num_ranks > {ranks_per_node}"),
        )
        for old, new in subs:
            assert old in source, f"{name}.py no longer says {old!r}"
            source = source.replace(old, new)
    if VENDOR not in sys.path:
        sys.path.insert(0, VENDOR)  # (its ``import test_low_latency``)
    spec = importlib.util.spec_from_loader(name, loader=None, origin=os.path.join(VENDOR, f"{name}.py"))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, spec.origin or name, "exec"), module.__dict__)  # noqa: S102 - DeepEP's test, verbatim
    return module


def run(info: Any, name: str, args: dict, ranks_per_node: int) -> bool:
    """A rank of DeepEP's ``name`` test: its ``test_loop(local_rank, num_local_ranks, args)``, unchanged."""
    install(info.group)
    os.environ["WORLD_SIZE"] = str(info.world_size // ranks_per_node)  # DeepEP's number of nodes
    module = load(name, ranks_per_node)
    keep, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None  # the launcher's to destroy
    torch.manual_seed(info.rank)
    try:
        with CudaIsCpu():
            module.test_loop(info.rank % ranks_per_node, ranks_per_node, argparse.Namespace(**args))
    finally:
        dist.destroy_process_group = keep
        torch.set_default_dtype(torch.float32)
    return True
