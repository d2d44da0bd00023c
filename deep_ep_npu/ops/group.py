"""Resolving ``group_ep`` / ``group_tp`` (a ``ProcessGroup`` or its name) to a process group."""

from __future__ import annotations

import torch.distributed as dist

from .errors import invalid, null


def resolve_group(group: dist.ProcessGroup | str | None, param: str) -> dist.ProcessGroup:
    """Return the process group ``group`` names (``ProcessGroup.group_name``) or ``group`` itself.

    Raises:
        MoeDistributeError: ``group`` is None or empty (161001), or names no group of this process (161002).
    """
    if group is None or group == "":
        raise null(param, "pass the EP ProcessGroup or its group name")
    if isinstance(group, dist.ProcessGroup):
        return group
    if not isinstance(group, str):
        raise invalid(param, f"must be a ProcessGroup or its name (str), got {type(group).__name__}")
    if not dist.is_initialized():
        raise invalid(param, f"no process group named {group!r}: torch.distributed is not initialized")
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        if name == group:
            return pg
    known = sorted(dist.distributed_c10d._world.pg_names.values())
    raise invalid(param, f"no process group named {group!r} in this process; known names: {known}")
