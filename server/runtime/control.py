"""The per-step control messages of a ``torchrun`` job, over its gloo control group: rank 0 sends each rank only its
own message (:func:`send_each`: its plan, pickled, point to point: its length, then its bytes), so a step's control
traffic into a rank is what that rank needs, not every rank's plans; the ranks' replies are gathered to rank 0
(:func:`gather_replies`, each rank sending its own)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

_LENGTH_TAG, _BODY_TAG = 1, 2


def send_each(group: Any, messages: dict[int, Any]) -> None:
    """Rank 0: send ``messages[r]`` to each rank ``r`` (group ranks; rank 0's own is not sent)."""
    import torch.distributed as dist

    works = []
    keep = []  # the tensors stay alive until their sends are done
    for rank, message in messages.items():
        if rank == 0:
            continue
        body = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        length = torch.tensor([body.numel()], dtype=torch.int64)
        keep += [length, body]
        peer = dist.get_global_rank(group, rank)
        works += [
            dist.isend(length, peer, group=group, tag=_LENGTH_TAG),
            dist.isend(body, peer, group=group, tag=_BODY_TAG),
        ]
    for work in works:
        if work is not None:
            work.wait()


def receive_own(group: Any) -> Any:
    """A rank > 0: its next message from rank 0 (:func:`send_each`)."""
    import torch.distributed as dist

    source = dist.get_global_rank(group, 0)
    length = torch.empty((1,), dtype=torch.int64)
    dist.recv(length, source, group=group, tag=_LENGTH_TAG)
    body = torch.empty((int(length[0]),), dtype=torch.uint8)
    dist.recv(body, source, group=group, tag=_BODY_TAG)
    return pickle.loads(body.numpy().tobytes())


def gather_replies(group: Any, reply: Any, world_size: int, rank: int) -> list[Any] | None:
    """Every rank's ``reply`` at rank 0 (rank order; None elsewhere)."""
    import torch.distributed as dist

    replies: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(reply, replies, dst=0, group=group)
    return replies
