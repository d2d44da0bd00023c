"""How a Buffer's rows move: :class:`Collective` (torch.distributed: gloo / NCCL / HCCL) or :class:`Shm` (a
shared-memory window of the ranks of one host, :mod:`.window`), chosen once per Buffer by :func:`create_transport`.

Both run the same engine jobs (plan, rows, layouts, reduction) and give bit-identical results. The shm transport
serves calls whose tensors are on the CPU; others (CUDA / NPU tensors) take the collective one. The flat (Ascend)
layout, the two-stage ops and the TP stage always take the collective transport.
"""

from __future__ import annotations

import abc

import torch.distributed as dist

from .. import envs
from ..event import Completion
from ..group import EPGroup
from .combine import CombineJob, start_combine
from .dispatch import DispatchJob, start_dispatch
from .shm import start_combine_shm, start_dispatch_shm
from .window import DEFAULT_WINDOW_BYTES, ShmWindow
from .window_setup import create_window

TRANSPORTS = ("auto", "shm", "collective")


class Transport(abc.ABC):
    """Runs the send phase of a dispatch / combine job and returns its receive phase."""

    name: str = ""

    def __init__(self, ep: EPGroup) -> None:
        self.ep = ep

    @abc.abstractmethod
    def dispatch(self, job: DispatchJob) -> Completion: ...
    @abc.abstractmethod
    def combine(self, job: CombineJob) -> Completion: ...
    @abc.abstractmethod
    def reject(self, op: str, code: int, num_counts: int, num_shared: int) -> None:
        """This rank rejected its input of ``op`` (``EPGroup.reject``'s arguments): the peers raise too."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release the transport's resources (the Buffer was destroyed)."""


class Collective(Transport):
    """torch.distributed collectives (:func:`~.dispatch.start_dispatch`, :func:`~.combine.start_combine`)."""

    name = "collective"

    def dispatch(self, job: DispatchJob) -> Completion:
        return start_dispatch(job)

    def combine(self, job: CombineJob) -> Completion:
        return start_combine(job)

    def reject(self, op: str, code: int, num_counts: int, num_shared: int) -> None:
        self.ep.reject(op, code, num_counts, num_shared)


class Shm(Collective):
    """The shared-memory window; jobs with tensors off the CPU or a TP stage run collectively."""

    name = "shm"

    def __init__(self, ep: EPGroup, window: ShmWindow) -> None:
        super().__init__(ep)
        self.window = window

    def dispatch(self, job: DispatchJob) -> Completion:
        if job.x.device.type != "cpu" or job.before_send is not None:
            return start_dispatch(job)
        return start_dispatch_shm(job, self.window)

    def combine(self, job: CombineJob) -> Completion:
        if job.source.device.type != "cpu" or job.before_send is not None:
            return start_combine(job)
        return start_combine_shm(job, self.window)

    def reject(self, op: str, code: int, num_counts: int, num_shared: int) -> None:
        self.window.reject(op, code, num_counts + num_shared)

    def close(self) -> None:
        self.window.close()


def resolve_transport_name(name: str | None) -> str:
    """``name``, else ``DEEP_EP_NPU_TRANSPORT``, else ``"auto"``; raises ValueError for anything outside
    :data:`TRANSPORTS`."""
    if name is None:
        name = envs.transport() or "auto"
    if name not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {list(TRANSPORTS)}, got {name!r}")
    return name


def create_transport(ep: EPGroup, name: str, window_bytes: int = 0) -> Transport:
    """The transport ``name`` for ``ep`` (collective on every rank of the group): ``"auto"`` is the shm transport
    when the group's backend is gloo, it has more than one rank and every rank can share memory with every other
    (checked, see :mod:`.window`), else the collective one; ``"shm"`` raises ValueError where it is not possible.
    ``window_bytes``: each rank's window size (at least :data:`~.window.DEFAULT_WINDOW_BYTES`)."""
    if name == "collective" or ep.num_ranks == 1:
        return Collective(ep)
    backend = str(dist.get_backend(ep.group)).lower()
    if "gloo" not in backend:
        if name == "shm":
            raise ValueError(f"transport: 'shm' needs a gloo (CPU) group, got backend {backend!r}; pass 'auto'")
        return Collective(ep)
    window = create_window(ep, max(window_bytes, DEFAULT_WINDOW_BYTES), required=name == "shm")
    return Collective(ep) if window is None else Shm(ep, window)


__all__ = ["TRANSPORTS", "Collective", "Shm", "Transport", "create_transport", "resolve_transport_name"]
