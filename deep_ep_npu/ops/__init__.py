"""The Ascend MoE distribute ops with torch_npu's signatures, on the one engine (:mod:`deep_ep_npu.engine`).

``moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` take exactly the arguments of torch_npu's
``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` (the union of the A2 / A3 / Ascend 950
semantics; ``strict`` enforces one platform's), plus our ``ccl_buffer_size`` and ``strict``; the ``*_start`` variants
(ours) split them into a send and a receive phase; ``moe_distribute_{dispatch,combine}_{setup,teardown}`` are
torch_npu's two-stage ops (:mod:`.two_stage`). Invalid input (checked by :mod:`deep_ep_npu.core.ascend`) raises on
every rank; a peer that exits or stops calling raises :class:`~deep_ep_npu.EPRankFailure` naming it within the group's
timeout (``DEEP_EP_NPU_TIMEOUT``, else 30 s).
"""

from __future__ import annotations

from ..errors import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, MoeDistributeError
from ..sizes import get_low_latency_ccl_buffer_size
from .context import create_context
from .two_stage import (
    moe_distribute_combine_setup,
    moe_distribute_combine_teardown,
    moe_distribute_dispatch_setup,
    moe_distribute_dispatch_teardown,
)
from .update_expert import moe_update_expert
from .v2 import (
    moe_distribute_combine_start,
    moe_distribute_combine_v2,
    moe_distribute_dispatch_start,
    moe_distribute_dispatch_v2,
)
from .v3 import moe_distribute_combine_v3, moe_distribute_dispatch_v3

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_PARAM_NULLPTR", "MoeDistributeError",
    "create_context", "get_low_latency_ccl_buffer_size", "moe_distribute_combine_setup",
    "moe_distribute_combine_start", "moe_distribute_combine_teardown", "moe_distribute_combine_v2",
    "moe_distribute_combine_v3", "moe_distribute_dispatch_setup", "moe_distribute_dispatch_start",
    "moe_distribute_dispatch_teardown", "moe_distribute_dispatch_v2", "moe_distribute_dispatch_v3",
    "moe_update_expert",
]  # fmt: skip
