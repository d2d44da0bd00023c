"""An NPU stand-in: run code written against torch_npu's MoE distribute ops on CPU tensors over gloo.

:func:`install` registers ``sys.modules["torch_npu"]``, a module with exactly these attributes:

- ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``: :mod:`deep_ep_npu.ops`'s
  ``moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` (torch_npu's signatures, our engine);
- ``npu_moe_distribute_dispatch_setup`` / ``_dispatch_teardown`` / ``_combine_setup`` / ``_combine_teardown``: the
  ``deep_ep_npu.ops`` functions of the same names without ``npu_`` (looked up when accessed);
- ``npu_format_cast(tensor, acl_format)``: returns ``tensor`` (there are no private NPU formats);
- torch_npu's dtype constants as ints (:data:`deep_ep_npu.npu_types.TORCH_NPU_CONSTANTS`: ``int4``, ``hifloat8``,
  ``float8_e5m2``, ``float8_e4m3fn``, ``float8_e8m0fnu``, ``float4_e2m1fn_x2``, ``float4_e1m2fn_x2``);
- ``__version__`` ``"2.14.0+sim"``, ``SIMULATED = True``, ``device_type = "cpu"`` (the ops take CPU tensors).

It also makes the line callers use to name a group work unchanged,
``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``, returning :func:`hccl_comm_name`:
``ProcessGroup._get_backend`` is patched for device type ``"npu"``, and for ``torch.device("npu")`` the privateuse1
backend is named ``"npu"`` (only while it is unnamed) with hooks that report no device built or available, so c10d's
device probe (``dist.barrier()``) keeps choosing the CPU. Neither can be undone in a process, so after
:func:`uninstall` ``torch.device("npu")`` stays valid (do not load a real torch_npu later in that process), and
``torch.accelerator.is_available()`` / ``torch.random.fork_rng()`` (which look for ``torch.npu``) raise. The ops
accept the name (or the group, or its group name) as ``group_ep`` / ``group_tp``. The stand-in MegaMoE op
``torch.ops._C_ascend.dispatch_ffn_combine`` is registered too (:mod:`deep_ep_npu.sim.fused`). ``torch.npu`` is not
faked, so ``Buffer(backend="auto")`` keeps choosing the reference backend; pass ``backend="ascend"`` to run the
Ascend backend's real code path on the stand-in.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch.distributed as dist

from ..transports.names import register_comm_name, unregister_comm_name
from . import fused
from .module import make_module, name_npu_device, patched_get_backend

__all__ = ["hccl_comm_name", "install", "installed", "uninstall"]

_state: dict[str, Any] = {}  # while installed: "module", "get_backend" (ProcessGroup's original method)
_comm_names: set[str] = set()


def hccl_comm_name(group: dist.ProcessGroup) -> str:
    """The stand-in communicator name of ``group``, ``"sim_hccl_<group_name>"`` (the same on every rank), registered
    so that the ops' ``group_ep`` / ``group_tp`` resolve it to ``group`` (until :func:`uninstall`)."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    name = f"sim_hccl_{group.group_name}"
    register_comm_name(name, group)
    _comm_names.add(name)
    return name


def installed() -> bool:
    """True while this stand-in is ``sys.modules["torch_npu"]``."""
    return "module" in _state and sys.modules.get("torch_npu") is _state["module"]


def install() -> types.ModuleType:
    """Register the stand-in as ``torch_npu`` and return it (idempotent). Raises RuntimeError when a real
    ``torch_npu`` is already imported, or when torch's privateuse1 backend already has another name."""
    if installed():
        return _state["module"]
    uninstall()  # an earlier install whose module was removed from sys.modules by hand
    current = sys.modules.get("torch_npu")
    if current is not None:
        where = getattr(current, "__file__", None) or getattr(current, "__spec__", None)
        msg = f"torch_npu is already imported ({where}); deep_ep_npu.sim would shadow it. On an NPU use the real one;"
        raise RuntimeError(f"{msg} elsewhere call sim.install() before anything imports torch_npu")
    name_npu_device()
    original = vars(dist.ProcessGroup)["_get_backend"]
    dist.ProcessGroup._get_backend = patched_get_backend(original, hccl_comm_name)  # type: ignore[method-assign]
    _state.update(module=make_module(), get_backend=original)
    fused.register()
    sys.modules["torch_npu"] = _state["module"]
    return _state["module"]


def uninstall() -> None:
    """Undo :func:`install` (idempotent): remove ``torch_npu``, restore ``ProcessGroup._get_backend``, unregister the
    fused op and forget the communicator names. The ``"npu"`` device name stays (torch cannot undo it)."""
    if not _state:
        return
    if sys.modules.get("torch_npu") is _state["module"]:
        del sys.modules["torch_npu"]
    dist.ProcessGroup._get_backend = _state["get_backend"]  # type: ignore[method-assign]
    fused.unregister()
    for name in _comm_names:
        unregister_comm_name(name)
    _comm_names.clear()
    _state.clear()
