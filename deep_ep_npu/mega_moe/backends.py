"""MegaMoE backends: one small ABC and a registry keyed by name (``reference``, ``ascend``, ``auto``).

``ascend`` calls the fused NPU op when the installed stack provides it and the call fits it (see
:mod:`deep_ep_npu.mega_moe.ascend`); otherwise it runs the reference pipeline, which works on any torch.distributed
backend. Every rank must take the same path, so :meth:`MegaMoeBackend.can_fuse` is agreed on across ranks first.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from ..backends import npu_available
from . import ascend
from .params import MegaMoeArgs
from .pipeline import run_reference


class MegaMoeBackend(abc.ABC):
    """Runs one validated MegaMoE call."""

    name: str

    def can_fuse(self, args: MegaMoeArgs) -> bool:
        """Whether this rank could run the call as one fused device op (every rank must agree to use it)."""
        return False

    @abc.abstractmethod
    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        """Return `[M, K]` with ``args.out_dtype``; ``fused`` is True only if every rank's :meth:`can_fuse` was."""


class ReferenceMegaMoe(MegaMoeBackend):
    """The pipelined reference path over the two-stage ops (:mod:`deep_ep_npu.mega_moe.pipeline`)."""

    name = "reference"

    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        return run_reference(args)


class AscendMegaMoe(MegaMoeBackend):
    """The fused NPU op ``torch.ops._C_ascend.dispatch_ffn_combine`` when present, else the reference pipeline.

    Arguments:
        fused_op: the op to call (tests pass a fake); by default looked up after importing ``torch_npu``.
        group_name: ``ProcessGroup -> HCCL comm name`` (default: ``ascend.hccl_comm_name``).
        prepare_weight: how a weight is put into the op's layout (default: ``ascend.to_npu_nz``).
        device_type: the device x must be on for the fused op (``"npu"``; tests pass ``"cpu"``).
    """

    name = "ascend"

    def __init__(
        self,
        fused_op: Callable[..., object] | None = None,
        group_name: Callable[..., str] | None = None,
        prepare_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
        device_type: str = "npu",
    ) -> None:
        self.fused_op = fused_op if fused_op is not None else ascend.find_fused_op()
        self.group_name = group_name or ascend.hccl_comm_name
        self.prepare_weight = prepare_weight or ascend.to_npu_nz
        self.device_type = device_type

    def can_fuse(self, args: MegaMoeArgs) -> bool:
        return (
            self.fused_op is not None
            and args.x.device.type == self.device_type
            and ascend.fused_op_blocker(args) is None
        )

    def run(self, args: MegaMoeArgs, fused: bool) -> torch.Tensor:
        if not fused:
            return run_reference(args)
        kwargs = ascend.fused_op_kwargs(args, self.group_name(args.group, args.rank), self.prepare_weight)
        self.fused_op(**kwargs)
        return kwargs["out"].to(args.out_dtype)


_REGISTRY: dict[str, Callable[[], MegaMoeBackend]] = {"reference": ReferenceMegaMoe, "ascend": AscendMegaMoe}


def available_backends() -> list[str]:
    return sorted([*_REGISTRY, "auto"])


def create_backend(name: str) -> MegaMoeBackend:
    """The backend registered as ``name``; ``auto`` picks ``ascend`` when torch_npu and an NPU are present (as the
    Buffer does), else ``reference``."""
    if name == "auto":
        name = "ascend" if npu_available() else "reference"
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown MegaMoE backend {name!r}; available: {available_backends()}")
    return _REGISTRY[name]()
