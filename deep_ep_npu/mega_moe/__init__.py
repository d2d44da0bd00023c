"""Fused MegaMoE: dispatch -> GMM1 -> SwiGLU -> GMM2 -> combine in one call, pipelined per local expert.

``mega_moe(group, x, topk_idx, topk_weights, w1, w2, ...)`` is the entry point (``Buffer.mega_moe`` delegates to
it); :mod:`.ffn` is the exact expert math, :mod:`.pipeline` the overlapped schedule over the two-stage ops,
:mod:`.ascend` the backend registry and the fused NPU op mapping.
"""

from .api import mega_moe
from .ascend import AscendMegaMoe, MegaMoeBackend, ReferenceMegaMoe, available_backends, create_backend
from .ffn import float_expert_ffn, int8_expert_ffn

__all__ = [
    "AscendMegaMoe", "MegaMoeBackend", "ReferenceMegaMoe", "available_backends", "create_backend", "float_expert_ffn",
    "int8_expert_ffn", "mega_moe",
]  # fmt: skip
