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
    _COMM_NAMES.pop(name, None)


def _hccl_comm_names(groups: Iterable[dist.ProcessGroup]) -> dict[str, dist.ProcessGroup]:
    """The existing HCCL communicators' names (``init_comm=False``) of ``groups``, with a real torch_npu loaded."""
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
        except (RuntimeError, ValueError, TypeError, AttributeError):  # a group whose probe fails is skipped
            continue
    return found


def resolve_group(group: object, param: str) -> dist.ProcessGroup:
    """The process group ``group`` is or names (see the module docstring). Raises :class:`MoeDistributeError` when
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
    alive = set(map(id, groups))
    comm_names = {n: g for n, ref in _COMM_NAMES.items() if (g := ref()) is not None and id(g) in alive}
    if group not in comm_names:
        comm_names |= _hccl_comm_names(groups)
    if group in comm_names:
        return comm_names[group]
    known = f"group names {sorted(groups.values())}, communicator names {sorted(comm_names)}"
    raise invalid(param, f"no process group or communicator named {group!r} in this process; known: {known}")
