"""torch_npu's ``npu_moe_update_expert``
(https://github.com/Ascend/op-plugin/blob/2ef21a0/docs/context/torch_npu-npu_moe_update_expert.md): logical top-k ids ->
physical ids through an EPLB table, before ``moe_distribute_dispatch_v2`` with ``moe_expert_num`` = the table's total
replica count. One implementation, with torch_npu's signature: :func:`deep_ep_npu.eplb.update_expert`."""

from __future__ import annotations

from ..eplb.routing import update_expert as moe_update_expert

__all__ = ["moe_update_expert"]
