"""An NPU stand-in: run code written against torch_npu's MoE distribute ops on CPU tensors over gloo.

:func:`install` registers ``sys.modules["torch_npu"]``, a module with exactly these attributes: the
``npu_moe_distribute_{dispatch,combine}_{v2,setup,teardown}`` ops and ``npu_moe_update_expert`` (the
:mod:`deep_ep_npu.ops` functions of the same names without ``npu_``), ``npu_format_cast(tensor, acl_format)``
(returns ``tensor``), torch_npu's dtype constants as ints (:data:`deep_ep_npu.core.platforms.TORCH_NPU_CONSTANTS`),
``__version__`` ``"2.14.0+sim"``, ``SIMULATED = True`` and ``device_type = "cpu"``. It also registers the stand-in
MegaMoE op ``torch.ops._C_ascend.dispatch_ffn_combine`` (:mod:`.fused`), vllm-ascend's routing op
``torch.ops._C_ascend.npu_moe_init_routing_custom`` (:mod:`.routing_custom`) and makes
``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)`` return :func:`hccl_comm_name`, which the ops take
as ``group_ep`` / ``group_tp``. For that ``torch.device("npu")`` becomes valid, which a process cannot undo: do not
load a real torch_npu after :func:`uninstall`, and ``torch.accelerator.is_available()`` / ``torch.random.fork_rng()``
raise. ``torch.npu`` (and ``torch_npu.npu``) is :mod:`.npu_device`'s stand-in (streams, events, device calls as CPU
no-ops; ``is_available()`` False), so ``Buffer(backend="auto")`` keeps choosing the reference backend;
``backend="ascend"`` runs the Ascend backend's code (on CANN's context ops, as it does on an NPU where CANN's
extension is installed, unless ``install(cann=False)``). The module also has torch_npu's local routing ops
``npu_moe_init_routing_v2``, ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` (:mod:`.routing`), and
``torch.histc`` counts integer tensors as on an NPU (:mod:`.histc`).

With ``cann=True`` (the default) it also installs CANN ops-transformer's torch extension, ``cann_ops_transformer`` and
``npu_ops_transformer`` with their ``ops`` modules and ``torch.ops`` context ops (:mod:`.cann`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

from ..core.platforms import TORCH_NPU_CONSTANTS
from ..transports.names import register_comm_name, unregister_comm_name
from . import cann as _cann
from . import fused, histc, npu_device, routing, routing_custom

__all__ = ["hccl_comm_name", "install", "installed", "uninstall"]

VERSION = "2.14.0+sim"  # the torch_npu release whose op signatures deep_ep_npu.ops mirrors; "+sim": the stand-in
_OP_NAMES = ("dispatch_v2", "combine_v2", "dispatch_setup", "dispatch_teardown", "combine_setup", "combine_teardown")
OPS = {f"npu_moe_distribute_{op}": f"moe_distribute_{op}" for op in _OP_NAMES} | {
    "npu_moe_update_expert": "moe_update_expert"
}
"""torch_npu's name -> the :mod:`deep_ep_npu.ops` function it is, looked up at each attribute access."""
ROUTING = ("npu_moe_init_routing_v2", "npu_moe_token_permute", "npu_moe_token_unpermute")  # (:mod:`.routing`)
_state: dict[str, Any] = {}  # while installed: "module", "get_backend" (ProcessGroup's original), "cann" (modules)
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


def install(cann: bool = True) -> types.ModuleType:
    """Register the stand-in as ``torch_npu`` (and, with ``cann``, CANN's extension packages) and return it
    (idempotent; ``cann`` counts on the first call). Raises RuntimeError when a real ``torch_npu`` (or, with
    ``cann``, a real ``cann_ops_transformer`` / ``npu_ops_transformer``) is already imported, or when torch's
    privateuse1 backend already has another name."""
    if installed():
        return _state["module"]
    uninstall()  # an earlier install whose module was removed from sys.modules by hand
    current = sys.modules.get("torch_npu")
    if current is not None:
        where = getattr(current, "__file__", None) or getattr(current, "__spec__", None)
        msg = f"torch_npu is already imported ({where}); deep_ep_npu.sim would shadow it. On an NPU use the real one;"
        raise RuntimeError(f"{msg} elsewhere call sim.install() before anything imports torch_npu")
    if cann and (real := [p for p in _cann.PACKAGES if p in sys.modules]):
        raise RuntimeError(f"{real} already imported; deep_ep_npu.sim would shadow it (use install(cann=False))")
    _name_npu_device()
    original = vars(dist.ProcessGroup)["_get_backend"]

    def _get_backend(group: dist.ProcessGroup, device: Any) -> Any:  # "npu": the stand-in's communicator names
        return SimHcclBackend(group) if torch.device(device).type == "npu" else original(group, device)

    dist.ProcessGroup._get_backend = _get_backend  # type: ignore[method-assign, assignment]
    _state.update(module=_make_module(), get_backend=original, cann=_cann.register() if cann else {})
    fused.register()
    routing_custom.register()
    histc.install()
    sys.modules["torch_npu"] = _state["module"]
    if not hasattr(torch, "npu"):  # (a real torch_npu's is never replaced)
        torch.npu = _state["npu"] = _state["module"].npu  # type: ignore[attr-defined]
    sys.modules.update(_state["cann"])
    return _state["module"]


def uninstall() -> None:
    """Undo :func:`install` (idempotent): remove ``torch_npu`` (and CANN's packages), restore
    ``ProcessGroup._get_backend``, unregister the fused and context ops and forget the communicator names. The
    ``"npu"`` device name stays (torch cannot undo it)."""
    if not _state:
        return
    if sys.modules.get("torch_npu") is _state["module"]:
        del sys.modules["torch_npu"]
    dist.ProcessGroup._get_backend = _state["get_backend"]  # type: ignore[method-assign]
    if "npu" in _state and getattr(torch, "npu", None) is _state["npu"]:
        del torch.npu  # type: ignore[attr-defined]
    fused.unregister()
    routing_custom.unregister()
    histc.uninstall()
    _cann.unregister(_state.get("cann", {}))
    for name in _comm_names:
        unregister_comm_name(name)
    _comm_names.clear()
    _state.clear()


def npu_format_cast(tensor: torch.Tensor, acl_format: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch_npu.npu_format_cast``: the stand-in has no private NPU memory formats; returns ``tensor`` itself."""
    return tensor


def _make_module() -> types.ModuleType:
    """A fresh ``torch_npu`` module (its ``__spec__`` makes ``importlib.util.find_spec("torch_npu")`` find it)."""
    mod = types.ModuleType("torch_npu", "deep_ep_npu.sim's torch_npu stand-in (MoE distribute ops on CPU tensors).")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin="deep_ep_npu.sim")
    local = {name: getattr(routing, name) for name in ROUTING}
    names = sorted([*TORCH_NPU_CONSTANTS, *OPS, *local, "npu", "npu_format_cast", "SIMULATED", "device_type"])

    def __getattr__(name: str) -> Any:
        if name not in OPS:
            raise AttributeError(f"the torch_npu stand-in (deep_ep_npu.sim) has no {name!r}; it provides {names}")
        fn = getattr(importlib.import_module("deep_ep_npu.ops"), OPS[name], None)
        if fn is None:
            raise AttributeError(f"torch_npu.{name}: deep_ep_npu.ops.{OPS[name]} does not exist in this version")
        return fn

    def __dir__() -> list[str]:
        return sorted({*mod.__dict__, *OPS})

    mod.__dict__.update(TORCH_NPU_CONSTANTS, __version__=VERSION, SIMULATED=True, device_type="cpu")
    mod.__dict__.update(npu_format_cast=npu_format_cast, __getattr__=__getattr__, __dir__=__dir__, **local)
    mod.npu = npu_device.module()  # type: ignore[attr-defined]
    return mod


class SimHcclBackend:
    """What ``group._get_backend(torch.device("npu"))`` returns while the stand-in is installed."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        """The group's :func:`hccl_comm_name`; ``rankid`` must be an int >= 0 (torch_npu only sanity-checks it),
        ``init_comm`` is accepted (there is no communicator to create)."""
        if isinstance(rankid, bool) or not isinstance(rankid, int) or rankid < 0:
            raise ValueError(f"get_hccl_comm_name: rankid must be an int >= 0, got {rankid!r}")
        return hccl_comm_name(self.group)


def _name_npu_device() -> None:
    """Make ``torch.device("npu")`` valid: name the privateuse1 backend ``"npu"`` (only while it is unnamed) and, if
    torch has no hooks for it yet, register hooks that report no device built or available, so c10d's device probe
    (``dist.barrier``, ``init_process_group`` without a backend) keeps choosing the CPU. Neither can be undone."""
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", "npu"):
        msg = f"torch's privateuse1 backend is already named {name!r}, so torch.device('npu') cannot work"
        raise RuntimeError(f"{msg}; deep_ep_npu.sim needs a process without another custom device backend")
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")
    try:
        torch._C._get_accelerator()  # raises while the named backend has no hooks
    except RuntimeError:
        acc: Any = torch._C._acc  # type: ignore[attr-defined]

        class NoDeviceHooks(acc.PrivateUse1Hooks):
            def is_available(self) -> bool:
                return False

            def has_primary_context(self, device_index: int) -> bool:
                return False

            def is_built(self) -> bool:
                return False

        acc.register_python_privateuseone_hook(NoDeviceHooks())
