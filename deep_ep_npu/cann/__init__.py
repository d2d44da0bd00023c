"""CANN ops-transformer's torch extension (``cann_ops_transformer.ops`` / ``npu_ops_transformer.ops``) on our engine:
:class:`MoeDistributeBuffer` over the V3 context ops, CANN's own :class:`ElasticBuffer` (not DeepEP V2's
:class:`deep_ep_npu.ElasticBuffer`; both exist) with its :class:`EPHandle`, and :func:`mega_moe` on a
:class:`SymmBuffer`. :mod:`deep_ep_npu.sim` installs these as those modules."""

from .buffer import MoeDistributeBuffer
from .elastic import ElasticBuffer, EPHandle
from .mega import SymmBuffer, get_symm_buffer_for_mega_moe, mega_moe

__all__ = ["EPHandle", "ElasticBuffer", "MoeDistributeBuffer", "SymmBuffer", "get_symm_buffer_for_mega_moe", "mega_moe"]
