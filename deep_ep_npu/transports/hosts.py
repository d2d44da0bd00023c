"""Which ranks share a host: the ranks whose shared-memory window can reach each other. A host is what a process sees
of its machine: the kernel's boot id, its hostname, its network namespace (abstract unix sockets, and so the window's
handshake, live in it) and its ``/dev/shm`` (a private tmpfs, as a container or a mount namespace has, is another
host). Each rank reduces these to one 63-bit key (:func:`host_key`); the window's setup exchanges the keys once, in
its first agreement, and ranks with equal keys form a host (:func:`host_groups`)."""

from __future__ import annotations

import hashlib
import os
import socket


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _inode(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def host_identity() -> str:
    """What identifies this process's host: ``boot id|hostname|network namespace|/dev/shm`` (the last two as
    ``device:inode``; a part that cannot be read is empty)."""
    parts = (
        _read("/proc/sys/kernel/random/boot_id"),
        socket.gethostname(),
        _inode("/proc/self/ns/net"),
        _inode("/dev/shm"),
    )
    return "|".join(parts)


def host_key() -> int:
    """:func:`host_identity` hashed to a non-negative int64 (one header word)."""
    return int.from_bytes(hashlib.blake2b(host_identity().encode(), digest_size=8).digest(), "little") >> 1


def host_groups(keys: list[int]) -> list[list[int]]:
    """The ranks of each host (``keys[r]``: rank r's :func:`host_key`), hosts in order of their first rank."""
    groups: dict[int, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
