"""``deep_ep.utils`` / ``deep_ep.utils.event`` under :func:`deep_ep_npu.alias.install`: DeepEP's event types."""

from __future__ import annotations

from ..handle import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
