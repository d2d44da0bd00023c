"""The only place deep_ep_npu reads environment variables (read once, when a backend is created; never per call)."""

from __future__ import annotations

import os


def hccl_buffsize_mb() -> int | None:
    """``HCCL_BUFFSIZE`` (MB of HCCL window per communicator for the torch_npu ops), or None when it is not set.

    Raises:
        ValueError: it is set but is not a positive integer.
    """
    value = os.environ.get("HCCL_BUFFSIZE")
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HCCL_BUFFSIZE: must be a positive integer (MB), got {value!r}")
    return int(value)
