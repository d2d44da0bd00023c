"""The transfer engine under the KV transfer: :class:`TransferBackend` (register a worker's cache, read another
instance's registered memory straight into it) and :class:`MooncakeBackend`, Mooncake's Transfer Engine over TCP
with its P2P handshake (no metadata server; RDMA / Ascend transports on clusters); :class:`KVPull` is one request's
pull, which a decode worker runs before its step's forward (:func:`run_pull`)."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Sequence

import torch

from .layout import token_ranges


class TransferBackend(abc.ABC):
    """One worker's end of the KV transfer. ``segment``: the name other instances read this worker's memory by."""

    segment: str

    @abc.abstractmethod
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register ``tensors`` (the worker's cache, contiguous CPU or device memory) for transfers."""

    @abc.abstractmethod
    def read(self, segment: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes at ``remote[i]`` of ``segment`` to ``local[i]`` (registered memory of this
        worker) for every ``i``; raise ``RuntimeError`` if the transfer fails."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister what :meth:`register` registered."""


class MooncakeBackend(TransferBackend):
    """Mooncake's ``TransferEngine`` on ``protocol`` (``tcp``; ``rdma`` / ``ascend`` where the wheel has them),
    bound to ``host``, P2P handshake: the segment name is ``host:rpc_port``."""

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host} ({protocol}, P2P handshake)")
        self.segment = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        addrs = [t.data_ptr() for t in tensors]
        sizes = [t.numel() * t.element_size() for t in tensors]
        if self.engine.batch_register_memory(addrs, sizes) != 0:
            raise RuntimeError(f"Mooncake could not register {len(addrs)} KV cache tensors ({sum(sizes)} bytes)")
        self._registered += addrs

    def read(self, segment: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        code = self.engine.batch_transfer_sync_read(segment, list(local), list(remote), list(lengths))
        if code != 0:
            raise RuntimeError(f"Mooncake read of {sum(lengths)} bytes from segment {segment} failed (code {code})")

    def close(self) -> None:
        if self._registered:
            self.engine.batch_unregister_memory(self._registered)
            self._registered = []


TRANSFER_BACKENDS = ("mooncake",)


def make_backend(name: str, host: str) -> TransferBackend:
    """The transfer backend ``name`` (one of :data:`TRANSFER_BACKENDS`) of a worker on ``host``."""
    if name == "mooncake":
        return MooncakeBackend(host)
    raise ValueError(f"disaggregation-transfer-backend: {name!r} is not one of {list(TRANSFER_BACKENDS)}")


def cache_tensors(layers: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """A paged cache's tensors, layer-major (the order :class:`~server.disagg.layout.KVLayout` counts them in)."""
    return [t for layer in layers for t in layer]


@dataclasses.dataclass
class KVPull:
    """Read tokens ``[start, stop)`` of a request's prompt KV from a prefill worker into this worker's blocks.

    ``source`` names the prefill side in errors; ``segment`` its transfer segment; ``remote_bases`` /
    ``remote_block_bytes`` its cache tensors' addresses and bytes per block; ``remote_blocks`` / ``local_blocks``
    the request's block tables on each side. ``prompt_ids`` and ``first_token`` (the prefill's sample) start the
    sequence's sampler (penalties count the prompt)."""

    seq_id: int
    source: str
    segment: str
    remote_bases: list[int]
    remote_block_bytes: list[int]
    remote_blocks: list[int]
    local_blocks: list[int]
    start: int
    stop: int
    prompt_ids: list[int]
    first_token: int


@dataclasses.dataclass
class PullResult:
    """One pull's outcome on the worker: bytes read, seconds taken, or why it failed."""

    seq_id: int
    num_bytes: int
    seconds: float
    error: str | None = None


def run_pull(backend: TransferBackend, tensors: Sequence[torch.Tensor], block_size: int, pull: KVPull) -> PullResult:
    """Run ``pull`` into the cache ``tensors`` (:func:`cache_tensors` order); a failure is reported, not raised."""
    t0 = time.perf_counter()
    token_bytes = [t[0, 0].numel() * t.element_size() for t in tensors]
    local = token_ranges(
        [t.data_ptr() for t in tensors],
        [t[0].numel() * t.element_size() for t in tensors],
        token_bytes,
        pull.local_blocks,
        block_size,
        pull.start,
        pull.stop,
    )
    remote = token_ranges(
        pull.remote_bases, pull.remote_block_bytes, token_bytes, pull.remote_blocks, block_size, pull.start, pull.stop
    )
    try:
        backend.read(pull.segment, [a for a, _ in local], [a for a, _ in remote], [n for _, n in local])
    except RuntimeError as e:
        return PullResult(pull.seq_id, 0, time.perf_counter() - t0, f"the KV transfer from {pull.source} failed: {e}")
    return PullResult(pull.seq_id, sum(n for _, n in local), time.perf_counter() - t0)
