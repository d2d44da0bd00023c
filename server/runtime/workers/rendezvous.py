"""The rendezvous of locally spawned workers, on loopback only, hosted by the driver.

``init_process_group(init_method="tcp://127.0.0.1:port")`` makes rank 0's ``TCPStore`` listen on every interface
(``*:port``), and gloo picks its pair sockets' address from the host name. Here the driver binds the store's socket
to ``127.0.0.1`` itself and hands it over (``master_listen_fd``), every worker joins as a client, and gloo is told to
use the loopback interface, so nothing a worker listens on is reachable from another host. The store lives in the
driver, not in a worker, so it outlives any worker: survivors of a lost rank can still agree and regroup through
it (elastic mode).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


def serve_loopback_store(world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Start the workers' ``TCPStore`` in this process on ``127.0.0.1`` (a free port); returns it and its port."""
    import torch.distributed as dist

    listener = socket.create_server((LOOPBACK, 0), backlog=max(128, world_size))
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, port


def init_loopback_group(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    """Join the world group (torch.distributed ``backend``) of ``world_size`` local workers through the driver's
    store at ``127.0.0.1:port``."""
    import torch.distributed as dist

    # read by gloo when it creates its device; this worker process's own environment, set before any group exists
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)  # NCCL's bootstrap sockets (dist-backend nccl)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
