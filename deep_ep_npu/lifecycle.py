"""The lifecycle both buffers share (``Buffer``, ``ElasticBuffer``): ``destroy()`` with DeepEP's
``explicitly_destroy`` rule, release on deletion otherwise, and a clear error for use after destroy."""

from __future__ import annotations

import contextlib
from typing import Any

from .failure import EPRankFailure


class Destroyable:
    """Mixin over ``self._backend`` (a :class:`~deep_ep_npu.backends.Backend`), ``self.explicitly_destroy`` and
    ``self._destroyed`` (False at construction)."""

    _backend: Any
    explicitly_destroy: bool
    _destroyed: bool

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"this {type(self).__name__} was destroyed; create a new one")

    def destroy(self) -> None:
        """Release the buffers and communication context; needs ``explicitly_destroy=True`` (as DeepEP). A second call
        is a no-op; using the buffer afterwards raises. Collective: it first waits (bounded) for every live peer, so no
        rank tears its group down while a peer still finishes the last combine; a peer that is gone is not awaited."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs explicitly_destroy=True at construction (else it runs on deletion)")
        if not self._destroyed:
            self._destroyed = True
            with contextlib.suppress(EPRankFailure):
                self._backend.ep.barrier("destroy")
            self._backend.destroy()

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True) and not getattr(self, "_destroyed", True):
            self._destroyed = True
            self._backend.destroy()
