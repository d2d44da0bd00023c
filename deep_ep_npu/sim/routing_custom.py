"""The stand-in of vllm-ascend's own routing kernel ``torch.ops._C_ascend.npu_moe_init_routing_custom`` (what its
A2 / A3 device adaptor calls where A5's calls torch_npu's ``npu_moe_init_routing_v2`` with the same arguments).

The op (https://github.com/vllm-project/vllm-ascend, ``csrc/torch_binding.cpp``) has torch_npu's
``npu_moe_init_routing_v2`` contract, schema :data:`SCHEMA`; its CPU kernel is :func:`deep_ep_npu.sim.routing.
npu_moe_init_routing_v2` (dropless mode; ``expert_tokens_num_type`` 0 cumsum / 1 count; ``quant_mode`` -1 none / 1
dynamic int8; ``row_idx_type`` 0 / 1; other values raise ValueError naming them). Returns ``(expanded_x,
expanded_row_idx int32 [T * K], expert_tokens int64, expanded_scale fp32)``."""

from __future__ import annotations

from .custom_op import CustomOp
from .routing import npu_moe_init_routing_v2

SCHEMA = (
    "npu_moe_init_routing_custom(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
    "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
    "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
    "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)"
)
OP = CustomOp(SCHEMA, npu_moe_init_routing_v2)
register, unregister = OP.register, OP.unregister
