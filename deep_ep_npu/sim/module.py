"""The ``torch_npu`` stand-in module and the ``ProcessGroup._get_backend`` patch of :mod:`deep_ep_npu.sim`."""

from __future__ import annotations

import importlib
import importlib.machinery
import types
from collections.abc import Callable
from typing import Any

import torch

from ..core.platforms import TORCH_NPU_CONSTANTS

VERSION = "2.14.0+sim"  # the torch_npu release whose op signatures deep_ep_npu.ops mirrors; "+sim": the stand-in
OPS = {  # torch_npu's name -> the deep_ep_npu.ops function it is, looked up at each attribute access
    "npu_moe_distribute_dispatch_v2": "moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2": "moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_setup": "moe_distribute_dispatch_setup",
    "npu_moe_distribute_dispatch_teardown": "moe_distribute_dispatch_teardown",
    "npu_moe_distribute_combine_setup": "moe_distribute_combine_setup",
    "npu_moe_distribute_combine_teardown": "moe_distribute_combine_teardown",
}


def npu_format_cast(tensor: torch.Tensor, acl_format: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch_npu.npu_format_cast``: the stand-in has no private NPU memory formats; returns ``tensor`` itself."""
    return tensor


def make_module() -> types.ModuleType:
    """A fresh ``torch_npu`` module (its ``__spec__`` makes ``importlib.util.find_spec("torch_npu")`` find it)."""
    mod = types.ModuleType("torch_npu", "deep_ep_npu.sim's torch_npu stand-in (MoE distribute ops on CPU tensors).")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin="deep_ep_npu.sim")
    names = sorted([*TORCH_NPU_CONSTANTS, *OPS, "npu_format_cast", "SIMULATED", "device_type"])

    def __getattr__(name: str) -> Callable[..., Any]:
        if name not in OPS:
            raise AttributeError(f"the torch_npu stand-in (deep_ep_npu.sim) has no {name!r}; it provides {names}")
        fn = getattr(importlib.import_module("deep_ep_npu.ops"), OPS[name], None)
        if fn is None:
            raise AttributeError(f"torch_npu.{name}: deep_ep_npu.ops.{OPS[name]} does not exist in this version")
        return fn

    mod.__dict__.update(TORCH_NPU_CONSTANTS, __version__=VERSION, SIMULATED=True, device_type="cpu",
                        npu_format_cast=npu_format_cast, __getattr__=__getattr__,
                        __dir__=lambda: sorted({*mod.__dict__, *OPS}))  # fmt: skip
    return mod


class SimHcclBackend:
    """What ``group._get_backend(torch.device("npu"))`` returns while the stand-in is installed."""

    def __init__(self, group: Any, comm_name: Callable[[Any], str]) -> None:
        self.group, self._comm_name = group, comm_name

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        """The group's stand-in communicator name (``deep_ep_npu.sim.hccl_comm_name``); ``rankid`` must be an int
        >= 0 (torch_npu only sanity-checks it), ``init_comm`` is accepted (there is no communicator to create)."""
        if isinstance(rankid, bool) or not isinstance(rankid, int) or rankid < 0:
            raise ValueError(f"get_hccl_comm_name: rankid must be an int >= 0, got {rankid!r}")
        return self._comm_name(self.group)


def name_npu_device() -> None:
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


def patched_get_backend(original: Any, comm_name: Callable[[Any], str]) -> Callable[..., Any]:
    """``ProcessGroup._get_backend`` that answers device type ``"npu"`` with a :class:`SimHcclBackend` and
    delegates every other device to ``original``."""

    def _get_backend(group: Any, device: Any) -> Any:
        if torch.device(device).type == "npu":
            return SimHcclBackend(group, comm_name)
        return original(group, device)

    return _get_backend
