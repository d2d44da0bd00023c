"""Resolving ``group_ep`` / ``group_tp`` (a ``ProcessGroup`` or its name) to a process group."""

from __future__ import annotations

import torch.distributed as dist

from .errors import MoeDistributeError, invalid, null


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


def abort_peers(
    group_ep: object, group_tp: object, tp_world_size: object, header_width: int, err: MoeDistributeError
) -> None:
    """Take part in the header exchange with ``err``'s code when this rank's parameters were rejected, so the other
    ranks raise too instead of waiting. Needs ``group_ep`` (and, with TP, ``group_tp``) to name a group; if it does
    not, there is no group to tell and the peers fail on their collective timeout.
    """
    from . import comm  # comm imports errors only; local import keeps group.py free of payload code
    from .tp import tp_agree_status

    try:
        pg = resolve_group(group_ep, "group_ep")
    except MoeDistributeError:
        return
    w = dist.get_world_size(pg)
    comm.exchange_header(pg, w, err.code, [0] * w, [0] * w, [0] * header_width)
    if tp_world_size == 2:
        try:
            tp = resolve_group(group_tp, "group_tp")
        except MoeDistributeError:
            return
        if dist.get_world_size(tp) == 2:
            tp_agree_status(tp, err.code)
