"""The only place deep_ep_npu reads environment variables (read once, when a backend, a Buffer or a group's
``EPGroup`` is created, or on first use; never per call)."""

from __future__ import annotations

import contextlib
import functools
import os


def hccl_buffsize_mb() -> int | None:
    """``HCCL_BUFFSIZE`` (MB of HCCL window per communicator for the torch_npu ops), or None when it is not set.
    Raises ValueError when it is set but is not a positive integer."""
    if not (value := os.environ.get("HCCL_BUFFSIZE")):
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HCCL_BUFFSIZE: must be a positive integer (MB), got {value!r}")
    return int(value)


def timeout_s() -> float | None:
    """``DEEP_EP_NPU_TIMEOUT``: seconds each collective wait of the ops and the Buffer may take before the peers
    that did not take part are reported (:class:`deep_ep_npu.EPRankFailure`); None when it is not set.
    Raises ValueError when it is set but is not a positive (finite) number."""
    if not (value := os.environ.get("DEEP_EP_NPU_TIMEOUT")):
        return None
    with contextlib.suppress(ValueError):  # float() refuses it: not a number
        if 0 < (seconds := float(value)) < float("inf"):
            return seconds
    raise ValueError(f"DEEP_EP_NPU_TIMEOUT: must be a positive number of seconds, got {value!r}")


def transport() -> str | None:
    """``DEEP_EP_NPU_TRANSPORT``: the default transport of a Buffer (``auto`` / ``shm`` / ``collective``), or None when
    it is not set (checked where it is used: :func:`deep_ep_npu.transports.resolve_transport_name`)."""
    return os.environ.get("DEEP_EP_NPU_TRANSPORT") or None


def cpu_kernels() -> bool:
    """``DEEP_EP_NPU_CPU_KERNELS``: ``0`` turns the CPU kernels off (:mod:`deep_ep_npu.kernels`: CPU tensors take the
    torch code); anything else, or unset, leaves them on."""
    return os.environ.get("DEEP_EP_NPU_CPU_KERNELS", "1").strip() != "0"


@functools.cache
def check_values() -> bool | None:
    """``DEEP_EP_NPU_CHECK_VALUES``: whether the checks that read tensor values (ids in range, duplicate ids, counts,
    masks) run: ``1`` on every device, ``0`` nowhere, unset (None) on CPU tensors only (on a GPU / NPU each would be
    a device-to-host sync, and a capture error inside a graph). Read on first use (``check_values.cache_clear()``
    reads it again). Raises ValueError for any other value."""
    if not (value := os.environ.get("DEEP_EP_NPU_CHECK_VALUES", "").strip()):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"DEEP_EP_NPU_CHECK_VALUES: must be 0 or 1 (or unset: CPU tensors only), got {value!r}")
    return value == "1"


def alias_api() -> str:
    """``DEEP_EP_NPU_ALIAS_API``: which ``Buffer`` ``import deep_ep`` gives (:mod:`deep_ep_npu.alias`): ``deep_ep``
    (unset: DeepEP's, :class:`deep_ep_npu.Buffer`) or ``deep_ep_ascend`` (DeepEP-Ascend's low-latency layout,
    :class:`deep_ep_npu.buffer_deepep_ascend.DeepEPAscendBuffer`). Read when ``deep_ep`` is first imported. Raises
    ValueError for any other value."""
    value = os.environ.get("DEEP_EP_NPU_ALIAS_API") or "deep_ep"
    if value not in ("deep_ep", "deep_ep_ascend"):
        raise ValueError(f"DEEP_EP_NPU_ALIAS_API: must be 'deep_ep' or 'deep_ep_ascend', got {value!r}")
    return value
