"""The stand-in's ``torch.npu`` (and ``torch_npu.npu``): what code written for NPUs touches on import and around its
kernels, on the CPU. Work runs in call order on the calling thread, so streams and events are always complete:
``Stream`` / ``Event`` keep torch.cuda's methods (waits return at once, ``query()`` is True, ``elapsed_time``
measures the CPU time between two records), ``stream(s)`` is a context manager, device calls (``synchronize``,
``set_device``, ``empty_cache``) are no-ops. ``is_available()`` is False and ``device_count()`` 0, so nothing picks an
NPU device; ``current_device()`` is ``torch.device("cpu")`` (torch_npu's is the NPU's index, which torch resolves to
that NPU: engines place tensors with ``device=torch.npu.current_device()``, and the stand-in's NPU is the CPU)."""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator
from typing import Any

import torch


class Event:
    """``torch.npu.Event(enable_timing=False, blocking=False, interprocess=False)``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing, self._at = enable_timing, float("nan")

    def record(self, stream: Stream | None = None) -> None:
        self._at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Returns at once (the work before the record is done)."""

    def synchronize(self) -> None:
        """Returns at once."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record and ``end_event``'s (both recorded, timing enabled)."""
        if (
            not (self.enable_timing and end_event.enable_timing)
            or self._at != self._at
            or end_event._at != end_event._at
        ):
            raise RuntimeError("elapsed_time needs two recorded events created with enable_timing=True")
        return (end_event._at - self._at) * 1e3


class Stream:
    """``torch.npu.Stream(device=None, priority=0)``."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device, self.priority = device, priority

    def wait_stream(self, stream: Stream) -> None:
        """Returns at once."""

    def wait_event(self, event: Event) -> None:
        """Returns at once."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Returns at once."""

    def query(self) -> bool:
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_DEFAULT = Stream()
_current: list[Stream] = [_DEFAULT]


def current_stream(device: Any = None) -> Stream:
    return _current[-1]


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT


def set_stream(stream: Stream) -> None:
    _current[-1] = stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Make ``s`` current inside the block (None: no change)."""
    _current.append(s or _current[-1])
    try:
        yield
    finally:
        _current.pop()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def module() -> types.ModuleType:
    """A fresh ``torch.npu`` stand-in module."""
    mod = types.ModuleType("torch.npu", "deep_ep_npu.sim's torch.npu stand-in (CPU: streams and events complete).")
    mod.__dict__.update(
        Stream=Stream,
        Event=Event,
        current_stream=current_stream,
        default_stream=default_stream,
        set_stream=set_stream,
        stream=stream,
        synchronize=_noop,
        set_device=_noop,
        empty_cache=_noop,
        is_available=lambda: False,
        device_count=lambda: 0,
        current_device=lambda: torch.device("cpu"),
        is_initialized=lambda: True,
        SIMULATED=True,
    )
    return mod
