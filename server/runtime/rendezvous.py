"""The rendezvous of locally spawned workers, on loopback only.

``init_process_group(init_method="tcp://127.0.0.1:port")`` makes rank 0's ``TCPStore`` listen on every interface
(``*:port``), and gloo picks its pair sockets' address from the host name. Here rank 0 binds the store's socket to
``127.0.0.1`` itself and hands it over (``master_listen_fd``), and gloo is told to use the loopback interface, so
nothing a worker listens on is reachable from another host.
"""

from __future__ import annotations

import datetime
import os
import socket

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


def init_loopback_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join the gloo world group of ``world_size`` local workers whose store rank 0 serves on ``127.0.0.1:port``."""
    import torch.distributed as dist

    # read by gloo when it creates its device; this worker process's own environment, set before any group exists
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = socket.create_server((LOOPBACK, port), backlog=max(128, world_size))
        store = dist.TCPStore(LOOPBACK, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())  # fmt: skip
    else:
        store = dist.TCPStore(LOOPBACK, port, world_size, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
