"""The in-flight results of the Buffer: :class:`EventOverlap` (DeepEP's) and :class:`Completion`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EventOverlap:
    """DeepEP's completion object for ``async_finish=True``. ``event``: anything with ``wait()`` (a
    ``torch.cuda.Event`` / ``torch.npu.Event``, whose ``wait()`` makes the current stream wait, or a pending CPU
    receive), or None for a finished operation; ``extra_tensors``: kept alive until the wait (DeepEP's
    CUDA-graph-safe ``record_stream``)."""

    def __init__(self, event: Any = None, extra_tensors: tuple | None = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        """Block (CPU) or make the current stream wait (device) until the operation is complete. Idempotent."""
        if self.event is not None:
            self.event.wait()
        self.extra_tensors = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        self.current_stream_wait()


class Completion:
    """The one in-flight type: the receive half of a split operation (a Buffer hook, an event, a ``*_start`` op).

    ``finish`` runs once, on the first ``wait()`` / call; later calls return its result or re-raise its error."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._finish is None

    def wait(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._result = finish()
            except BaseException as err:
                self._error = err
                raise
        elif self._error is not None:
            raise self._error
        return self._result

    __call__ = wait


class EventHandle:
    """DeepEP's ``EventHandle``: a point in the current stream, what ``capture()`` returns and ``previous_event``
    takes. This library's work runs in call order on the calling thread (no separate communication stream), so a
    captured event is already complete: ``current_stream_wait()`` returns at once."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for (see the class docstring)."""
