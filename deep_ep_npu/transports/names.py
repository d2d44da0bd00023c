"""Which process group a ``group_ep`` means: a ProcessGroup, its c10d group name, a communicator name registered by
:mod:`deep_ep_npu.sim`, or (with torch_npu loaded) its HCCL communicator name."""

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import invalid, null

_COMM_NAMES: dict[str, weakref.ref[dist.ProcessGroup]] = {}  # communicator names given out by deep_ep_npu.sim


def register_comm_name(name: str, group: dist.ProcessGroup) -> None:
    """Make ``name`` (a communicator name, e.g. ``deep_ep_npu.sim.hccl_comm_name``'s) resolve to ``group``."""
    _COMM_NAMES[name] = weakref.ref(group)


def unregister_comm_name(name: str) -> None:
    """Forget ``name`` (no-op when it is not registered)."""
    _COMM_NAMES.pop(name, None)


def _registered_comm_names(live: Iterable[dist.ProcessGroup]) -> dict[str, dist.ProcessGroup]:
    """The registered names whose group is still one of the ``live`` groups of this process."""
    alive = set(map(id, live))
    return {n: pg for n, ref in _COMM_NAMES.items() if (pg := ref()) is not None and id(pg) in alive}


def _hccl_comm_names(groups: Iterable[dist.ProcessGroup]) -> dict[str, dist.ProcessGroup]:
    """The HCCL communicator name of each group with an HCCL backend, when a real torch_npu is loaded (never the
    stand-in). Only communicators that exist are asked (``init_comm=False``); a group whose probe fails is skipped."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None or getattr(torch_npu, "SIMULATED", False):
        return {}
    found = {}
    for pg in groups:
        try:
            if "hccl" in str(dist.get_backend(pg)).lower():
                backend: Any = pg._get_backend(torch.device("npu"))
                if name := backend.get_hccl_comm_name(dist.get_rank(pg), init_comm=False):
                    found[name] = pg
        except (RuntimeError, ValueError, TypeError, AttributeError):
            continue
    return found


def resolve_group(group: object, param: str) -> dist.ProcessGroup:
    """The process group ``group`` is or names: its c10d group name (``ProcessGroup.group_name``), a communicator
    name registered by ``deep_ep_npu.sim.hccl_comm_name``, or, with torch_npu loaded, its HCCL communicator name
    (``pg._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``). Raises :class:`MoeDistributeError` when
    ``group`` is None or empty (161001), or names no group of this process (161002, listing the known names)."""
    if group is None or group == "":
        raise null(param, "pass the ProcessGroup, its group name or its communicator name")
    if isinstance(group, dist.ProcessGroup):
        return group
    if not isinstance(group, str):
        raise invalid(param, f"must be a ProcessGroup or a group / communicator name (str), got {type(group).__name__}")
    if not dist.is_initialized():
        raise invalid(param, f"no process group named {group!r}: torch.distributed is not initialized")
    groups = dict(dist.distributed_c10d._world.pg_names)  # ProcessGroup -> group name
    for pg, name in groups.items():
        if name == group:
            return pg
    comm_names = _registered_comm_names(groups)
    if group in comm_names:
        return comm_names[group]
    comm_names |= _hccl_comm_names(groups)
    if group in comm_names:
        return comm_names[group]
    known = f"group names {sorted(groups.values())}, communicator names {sorted(comm_names)}"
    raise invalid(param, f"no process group or communicator named {group!r} in this process; known: {known}")
