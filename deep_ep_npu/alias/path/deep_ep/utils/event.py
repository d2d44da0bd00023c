"""``deep_ep.utils.event`` of the ``PYTHONPATH`` form (DeepEP's event types)."""

from deep_ep_npu.alias.utils import EventHandle, EventOverlap  # noqa: F401
