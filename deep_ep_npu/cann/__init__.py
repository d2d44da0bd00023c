"""CANN ops-transformer's torch extension (``cann_ops_transformer.ops`` / ``npu_ops_transformer.ops``) on our engine:
:class:`MoeDistributeBuffer` over the V3 context ops. :mod:`deep_ep_npu.sim` installs these as those modules."""

from .buffer import MoeDistributeBuffer

__all__ = ["MoeDistributeBuffer"]
