"""The stand-in of CANN ops-transformer's torch extension: ``cann_ops_transformer`` (CANN 9.1+) and its old name
``npu_ops_transformer``, each a package whose ``ops`` module holds :mod:`deep_ep_npu.cann`'s front-ends, and their
context ops under ``torch.ops.<package>`` (CPU kernels: :mod:`deep_ep_npu.ops.v3`):

- ``cann_ops_transformer.ops``: ``MoeDistributeBuffer``, ``ElasticBuffer``, ``EPHandle``, ``mega_moe``,
  ``get_symm_buffer_for_mega_moe`` (re-exported by the package, as ``from .ops import *`` does);
  ``torch.ops.cann_ops_transformer.npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine`` (the V3 schemas,
  dispatch ending with ``x_smooth_scales_dtype``) and ``npu_mega_moe`` (:mod:`.cann_mega`).
- ``npu_ops_transformer.ops``: ``MoeDistributeBuffer`` (its context in the old layout, `[2052]`),
  ``npu_moe_distribute_dispatch_v3`` /
  ``npu_moe_distribute_combine_v3`` and ``npu_moe_distribute_{dispatch,combine}_v2`` (torch_npu's schemas);
  ``torch.ops.npu_ops_transformer.npu_moe_distribute_dispatch_v3`` / ``_combine_v3`` (dispatch ending with
  ``scales_dtype``).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import torch

from .. import cann, ops
from ..ops.v3 import moe_distribute_combine_v3, moe_distribute_dispatch_v3
from .cann_mega import SCHEMA as MEGA_SCHEMA
from .cann_mega import OldMoeDistributeBuffer, npu_mega_moe

_D = (
    "(Tensor context, Tensor x, Tensor expert_ids, int ep_world_size, int ep_rank_id, int moe_expert_num, "
    "int ccl_buffer_size, *, Tensor? scales=None, Tensor? x_active_mask=None, Tensor? expert_scales=None, "
    "Tensor? elastic_info=None, Tensor? performance_info=None, int tp_world_size=0, int tp_rank_id=0, "
    "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int quant_mode=0, "
    "int global_bs=0, int expert_token_nums_type=1, str comm_alg='', int zero_expert_num=0, int copy_expert_num=0, "
    "int const_expert_num=0, int? y_dtype=None, int? x_dtype=None, int? {}=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_C = (
    "(Tensor context, Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine, Tensor ep_send_counts, "
    "Tensor expert_scales, int ep_world_size, int ep_rank_id, int moe_expert_num, int ccl_buffer_size, *, "
    "Tensor? tp_send_counts=None, Tensor? x_active_mask=None, Tensor? expand_scales=None, "
    "Tensor? shared_expert_x=None, Tensor? elastic_info=None, Tensor? ori_x=None, Tensor? const_expert_alpha_1=None, "
    "Tensor? const_expert_alpha_2=None, Tensor? const_expert_v=None, Tensor? performance_info=None, "
    "int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, "
    "int shared_expert_rank_num=0, int global_bs=0, int comm_quant_mode=0, str comm_alg='', int zero_expert_num=0, "
    "int copy_expert_num=0, int const_expert_num=0) -> Tensor"
)
PACKAGES = ("cann_ops_transformer", "npu_ops_transformer")
_LIBS: list[torch.library.Library] = []


def _dispatch_new(*args: Any, x_smooth_scales_dtype: Any = None, **kw: Any) -> tuple[torch.Tensor, ...]:
    return moe_distribute_dispatch_v3(*args, scales_dtype=x_smooth_scales_dtype, **kw)


def _exports(package: str) -> dict[str, Any]:
    """What ``<package>.ops`` holds."""
    names: dict[str, Any] = {"MoeDistributeBuffer": cann.MoeDistributeBuffer}
    if package == "npu_ops_transformer":  # (its context: the old layout)
        names["MoeDistributeBuffer"] = OldMoeDistributeBuffer
    if package == "cann_ops_transformer":
        names.update(
            ElasticBuffer=cann.ElasticBuffer,
            EPHandle=cann.EPHandle,
            mega_moe=cann.mega_moe,
            get_symm_buffer_for_mega_moe=cann.get_symm_buffer_for_mega_moe,
        )
    else:  # the old package also registered torch_npu's group-name _v2 ops
        names.update(
            npu_moe_distribute_dispatch_v2=ops.moe_distribute_dispatch_v2,
            npu_moe_distribute_combine_v2=ops.moe_distribute_combine_v2,
            npu_moe_distribute_dispatch_v3=moe_distribute_dispatch_v3,
            npu_moe_distribute_combine_v3=moe_distribute_combine_v3,
        )
    return names


def register() -> dict[str, types.ModuleType]:
    """Define the torch ops (idempotent) and return the package and ``ops`` modules by name, for ``sys.modules``."""
    if not _LIBS:
        schemas = {
            "cann_ops_transformer": (
                ("npu_moe_distribute_dispatch", "x_smooth_scales_dtype", _dispatch_new),
                ("npu_moe_distribute_combine", None, moe_distribute_combine_v3),
            ),
            "npu_ops_transformer": (
                ("npu_moe_distribute_dispatch_v3", "scales_dtype", moe_distribute_dispatch_v3),
                ("npu_moe_distribute_combine_v3", None, moe_distribute_combine_v3),
            ),
        }
        for namespace, defs in schemas.items():
            lib = torch.library.Library(namespace, "FRAGMENT")
            _LIBS.append(lib)
            for name, last, fn in defs:
                lib.define(name + (_D.format(last) if last else _C))
                lib.impl(name, fn, "CPU")
            if namespace == "cann_ops_transformer":
                lib.define(MEGA_SCHEMA)
                lib.impl("npu_mega_moe", npu_mega_moe, "CPU")
    modules: dict[str, types.ModuleType] = {}
    for package in PACKAGES:
        pkg, ops_mod = types.ModuleType(package), types.ModuleType(f"{package}.ops")
        for mod in (pkg, ops_mod):
            mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, origin="deep_ep_npu.sim")
            mod.__dict__.update(_exports(package), SIMULATED=True)
        pkg.__path__ = []  # a package, so ``import <package>.ops`` works
        pkg.ops = ops_mod  # type: ignore[attr-defined]
        modules |= {package: pkg, f"{package}.ops": ops_mod}
    return modules


def unregister(modules: dict[str, types.ModuleType]) -> None:
    """Remove what :func:`register` registered: the torch ops and, where they are still ours, the modules."""
    while _LIBS:
        _LIBS.pop()._destroy()
    for name, mod in modules.items():
        if sys.modules.get(name) is mod:
            del sys.modules[name]
