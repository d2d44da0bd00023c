"""Where the workers run: the start-up check of ``device`` / ``dist-backend`` / ``backend`` / ``simulate-npu``, and
each worker's device binding.

Supported pairs of ``device`` and ``dist-backend`` (the EP group's torch.distributed backend): ``cpu`` + ``gloo``,
``cuda`` + ``nccl``, ``npu`` + ``hccl``. Control messages between the driver and the workers never use the EP group:
spawned workers talk over private pipes, torchrun ranks over a separate gloo group. :func:`check_placement` runs in
the driver (and in every torchrun rank) before any worker process starts or any group is joined, and raises a
``ValueError`` naming the option, its value and what is allowed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

DEVICES = ("cpu", "cuda", "npu")
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # device -> the EP group backend it takes
BACKENDS = ("auto", "reference", "ascend")
NPU_INSTALL = "pip install 'deep_ep_npu[npu]'"


def torch_npu_installed() -> bool:
    """A real torch_npu is importable here (the stand-in ``deep_ep_npu.sim`` does not count)."""
    return importlib.util.find_spec("torch_npu") is not None


def visible_devices(device: str) -> int:
    """How many devices of type ``device`` this process sees (``cpu``: unbounded, reported as a large number)."""
    import torch

    if device == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    return 1 << 30


def check_placement(device: str, dist_backend: str, backend: str, simulate_npu: bool, local_workers: int) -> None:
    """Refuse a combination that cannot run here; ``local_workers`` is the number of workers on this machine
    (``ep-size`` when spawned, torchrun's ``LOCAL_WORLD_SIZE`` under torchrun)."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"device: {device!r} is not one of {list(DEVICES)}")
    if dist_backend not in DIST_BACKENDS.values():
        raise ValueError(f"dist-backend: {dist_backend!r} is not one of {sorted(DIST_BACKENDS.values())}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {list(BACKENDS)}")
    if simulate_npu:
        if (device, dist_backend) != ("cpu", "gloo"):
            raise ValueError(
                f"simulate-npu: the stand-in runs on CPU tensors over gloo; got device {device!r}, dist-backend "
                f"{dist_backend!r} (allowed with simulate-npu: device cpu, dist-backend gloo)"
            )
        if torch_npu_installed():
            raise ValueError(
                "simulate-npu: a real torch_npu is installed here; the stand-in would shadow it. Drop simulate-npu "
                "and use device npu, dist-backend hccl"
            )
    if dist_backend == "hccl" and not torch_npu_installed():
        raise ValueError(
            f"dist-backend: 'hccl' needs torch_npu, which is not installed ({NPU_INSTALL}); allowed here: 'gloo' "
            "(device cpu), or 'nccl' (device cuda) with a GPU"
        )
    if dist_backend == "nccl" and not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        raise ValueError("dist-backend: 'nccl' needs CUDA and a torch built with NCCL; none here (use 'gloo')")
    if device == "npu" and not torch_npu_installed():
        raise ValueError(
            f"device: 'npu' needs torch_npu, which is not installed ({NPU_INSTALL}); allowed here: 'cpu' (or "
            "'cpu' with simulate-npu to run backend ascend on the stand-in)"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' needs a visible CUDA GPU; none here (allowed: 'cpu')")
    if DIST_BACKENDS[device] != dist_backend:
        raise ValueError(
            f"dist-backend: {dist_backend!r} does not carry {device} tensors; with device {device!r} use dist-backend "
            f"{DIST_BACKENDS[device]!r} (pairs: {', '.join(f'{d} + {b}' for d, b in DIST_BACKENDS.items())})"
        )
    if backend == "ascend" and not simulate_npu:
        if not torch_npu_installed():
            raise ValueError(
                f"backend: 'ascend' needs torch_npu ({NPU_INSTALL}) and device npu, or simulate-npu (the CPU "
                "stand-in); neither here (allowed: 'reference', 'auto')"
            )
        if device != "npu":
            raise ValueError(f"backend: 'ascend' runs on NPU tensors; got device {device!r} (use device npu)")
    if device != "cpu":
        have = visible_devices(device)
        if local_workers > have:
            raise ValueError(
                f"ep-size: {local_workers} workers on this machine need {local_workers} {device} devices (one each); "
                f"{have} visible"
            )


def bind_device(device: str, index: int, simulate_npu: bool = False) -> Any:
    """Make device ``index`` of type ``device`` this worker process's current device and return it as a
    ``torch.device`` (``cpu``: the CPU). With ``simulate_npu``, install the stand-in first (device stays cpu)."""
    import torch

    if simulate_npu:
        from deep_ep_npu import sim

        sim.install()
    if device == "cuda":
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)

        torch.npu.set_device(index)  # type: ignore[attr-defined]
        return torch.device("npu", index)
    return torch.device("cpu")
