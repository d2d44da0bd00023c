"""The Ascend MoE distribute V3 op semantics (flat layout), reimplemented over torch.distributed.

``moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` take exactly the keywords of
``torch_npu.npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``; the ``*_setup`` functions are the
two-stage form (send now, ``teardown()`` later).
"""

from .ccl_buffer import get_low_latency_ccl_buffer_size
from .combine import CombineHandle, moe_distribute_combine_setup
from .dispatch import DispatchHandle, moe_distribute_dispatch_setup
from .errors import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    MoeDistributeError,
)
from .oneshot import moe_distribute_combine_v2, moe_distribute_dispatch_v2

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR",
    "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_PARAM_NULLPTR",
    "CombineHandle",
    "DispatchHandle",
    "MoeDistributeError",
    "get_low_latency_ccl_buffer_size",
    "moe_distribute_combine_setup",
    "moe_distribute_combine_v2",
    "moe_distribute_dispatch_setup",
    "moe_distribute_dispatch_v2",
]
