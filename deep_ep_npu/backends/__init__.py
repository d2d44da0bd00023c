"""The one backend interface every front-end uses (:class:`Backend`) and its implementations by name: ``"reference"``
(:class:`deep_ep_npu.engine.exchange.Engine`) and ``"ascend"`` (:class:`.ascend.AscendBackend`, the real NPU ops;
``torch_npu`` is imported only when it is created). ``dispatch`` / ``combine`` run a validated call's send phase and
return its receive phase, an :class:`InFlight` the front-end completes at once, at an event's wait or in a hook (the one
in-flight object: hooks, events, ``*_start`` ops and ``comm_cmd_info`` wrap it); ``reject(op, code)`` tells the peers
that this rank rejected its input (they raise too)."""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import MoeDistributeError
from ..handle import EventOverlap
from ..transports.failure import EPRankFailure
from ..transports.group import EPGroup

if TYPE_CHECKING:
    from ..core.call import FFN, CombineCall, DispatchCall, FusedCall


class InFlight:
    """The receive phase of a call whose send phase ran: ``wait()`` runs ``finish`` once and returns ``value`` (the
    call's outputs, allocated by the send phase and filled by the receive; ``finish``'s result when it returns one).
    Later waits return the same value or re-raise the same error."""

    def __init__(self, finish: Callable[[], Any] | None, value: Any = None) -> None:
        self._finish, self.value = finish, value
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._finish is None

    def wait(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                got = finish()
            except BaseException as err:
                self._error = err
                raise
            self.value = self.value if got is None else got
        elif self._error is not None:
            raise self._error
        return self.value

    __call__ = wait

    def overlap(
        self, async_finish: bool, return_recv_hook: bool, tensors: tuple = ()
    ) -> tuple[EventOverlap, Callable[[], Any] | None]:
        """DeepEP's two overlap styles over this receive: a hook, an event (holding ``tensors``), or neither (the
        receive runs now); returns ``(event, hook)``."""
        if return_recv_hook:
            return EventOverlap(None), self.wait
        if async_finish:
            return EventOverlap(self, tensors), None
        self.wait()
        return EventOverlap(None), None


class Backend(abc.ABC):
    """Runs the front-ends' calls on one group. ``native_quant_format``: what DeepEP's ``use_fp8=True`` means here;
    ``agreed``: None when every call agrees with the peers before it runs (a rejection raises on every rank), else
    (a backend whose inputs are checked locally, the ascend one) the fingerprints of the MegaMoE calls agreed once:
    a later call with one of them runs without a round (:func:`deep_ep_npu.mega_moe.prepare`)."""

    name: str = ""
    native_quant_format: str = "fp8_e4m3"

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        timeout: float | None = None,
        enable_shrink: bool = False,
        transport: str = "collective",
        num_rdma_bytes: int = 0,
        ccl_buffer_size: int | None = None,
        reuse: bool = True,
    ) -> None:
        """``timeout``: seconds per collective wait (None: ``DEEP_EP_NPU_TIMEOUT``, else 30 s); ``enable_shrink``:
        continue on the survivors of a failure; ``transport`` / ``num_rdma_bytes``: how the engine moves rows and
        its window's size; ``ccl_buffer_size``: the Ascend ops' CCL window (MB, None: sized by the first call);
        ``reuse``: a buffer's tensors are reused (two calls in flight at most), else each call gets its own."""
        self.group, self.transport_name, self.num_rdma_bytes = group, transport, num_rdma_bytes
        self.ccl_buffer_size, self.reuse = ccl_buffer_size, reuse
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        with torch.inference_mode(False):  # (a normal tensor, whatever the caller's mode: its version tracks changes)
            self.mask = torch.zeros((self.num_ranks,), dtype=torch.int32)  # shrink mode: 1 = rank treated as absent
        self.ep = EPGroup(group, self.mask, timeout, enable_shrink)
        self.released = False
        self.agreed: set[tuple[int, ...]] | None = None  # (local checks: the fused calls' agreed fingerprints)

    @abc.abstractmethod
    def dispatch(self, call: DispatchCall) -> InFlight: ...

    @abc.abstractmethod
    def combine(self, call: CombineCall) -> InFlight: ...

    @abc.abstractmethod
    def can_fuse(self, call: FusedCall, ffn: FFN) -> bool:
        """Whether this rank could run the fused call as one device op (every rank must agree before it does)."""

    @abc.abstractmethod
    def mega_moe(self, call: FusedCall, ffn: FFN, fused: bool) -> torch.Tensor:
        """The fused call: one device op when ``fused`` (every rank's :meth:`can_fuse` was), else the pipeline."""

    @abc.abstractmethod
    def reject(self, op: str, code: int, tp: EPGroup | None = None) -> None: ...

    @contextlib.contextmanager
    def rejecting(self, op: str, names: dict[str, str] | None = None, tp: EPGroup | None = None) -> Iterator[None]:
        """A call's validation: a :class:`~deep_ep_npu.errors.MoeDistributeError` raised inside is told to the peers
        (:meth:`reject`: they raise too), then raised here, its parameter renamed by ``names`` (the front-end's)."""
        try:
            yield
        except MoeDistributeError as err:
            self.reject(op, err.code, tp)
            if names:
                raise err.renamed(names) from None
            raise

    @abc.abstractmethod
    def next_combine_buffer(self, handle: Any) -> torch.Tensor:
        """The `[L, R * N, hidden]` bfloat16 buffer the next ``zero_copy`` masked combine of ``handle`` reads."""

    @abc.abstractmethod
    def clean(self) -> None: ...

    @abc.abstractmethod
    def destroy(self) -> None: ...

    def release(self, explicitly_destroy: bool, called: bool) -> None:
        """A front-end's ``destroy()`` (``called``) or deletion, with DeepEP's ``explicitly_destroy`` rule, once.
        ``destroy()`` first waits (bounded) for the live peers, so none tears its group down mid-combine; not after a
        call raised :class:`EPRankFailure` (the group is broken: the peers it would wait for may be gone)."""
        if called and not explicitly_destroy:
            raise RuntimeError("destroy() needs explicitly_destroy=True at construction (else it runs on deletion)")
        if self.released or explicitly_destroy != called:
            return
        self.released = True
        if called and not self.ep.broken:
            with contextlib.suppress(EPRankFailure):
                self.ep.barrier("destroy")
        self.destroy()

    def check_alive(self, front: object) -> None:
        if self.released:
            raise RuntimeError(f"this {type(front).__name__} was destroyed; create a new one")


_REGISTRY = {"reference": "deep_ep_npu.engine.exchange:Engine", "ascend": f"{__name__}.ascend:AscendBackend"}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def hccl_comm_name(group: dist.ProcessGroup, rank: int) -> str:
    """The HCCL communicator name of ``group`` (what the NPU ops' group arguments take), asked of its ``"npu"``
    backend (creating the communicator if needed); with :mod:`deep_ep_npu.sim` installed, ``sim.hccl_comm_name``."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)  # type: ignore[attr-defined]


def npu_available() -> bool:
    """True when torch_npu is installed and reports an NPU (imports torch_npu only if it is installed)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(hasattr(torch, "npu") and torch.npu.is_available())


def resolve_backend_name(name: str) -> str:
    """``"auto"`` is ``"ascend"`` when torch_npu and an NPU are present, else ``"reference"``."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}; known: {['auto', *available_backends()]}")
    if name == "auto":
        return "ascend" if npu_available() else "reference"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {['auto', *available_backends()]}")
    return name


def create_backend(name: str, group: dist.ProcessGroup, **options: Any) -> Backend:
    """Build the backend registered as ``name`` (after resolving ``"auto"``) with :class:`Backend`'s options."""
    module_name, _, cls_name = _REGISTRY[resolve_backend_name(name)].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)(group, **options)


__all__ = [
    "Backend",
    "InFlight",
    "available_backends",
    "create_backend",
    "hccl_comm_name",
    "npu_available",
    "resolve_backend_name",
]
