"""Fused MegaMoE (:func:`mega_moe`; ``Buffer.mega_moe`` delegates to it): dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine
in one call. :mod:`.ffn`: exact expert math; :mod:`.pipeline`: overlapped schedule; :mod:`.ascend`: backends, NPU op."""

from .api import mega_moe
from .ascend import AscendMegaMoe, MegaMoeBackend, ReferenceMegaMoe, available_backends, create_backend
from .ffn import float_expert_ffn, int8_expert_ffn

__all__ = ["AscendMegaMoe", "MegaMoeBackend", "ReferenceMegaMoe", "available_backends", "create_backend",
           "float_expert_ffn", "int8_expert_ffn", "mega_moe"]  # fmt: skip
