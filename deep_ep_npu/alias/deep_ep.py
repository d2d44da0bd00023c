"""What ``import deep_ep`` gives after :func:`deep_ep_npu.alias.install` (with no DeepEP installed): DeepEP's public
names, this library's implementations. ``Buffer`` is :class:`deep_ep_npu.Buffer` (DeepEP's API), or with
``DEEP_EP_NPU_ALIAS_API=deep_ep_ascend`` :class:`deep_ep_npu.buffer_deepep_ascend.DeepEPAscendBuffer` (DeepEP-Ascend's
low-latency layout, what engines' NPU code reads: SGLang's Ascend MoE runner)."""

from __future__ import annotations

from .. import Buffer as _DeepEPBuffer
from .. import Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, envs, topk_idx_t
from .. import __version__ as __version__
from ..buffer_deepep_ascend import DeepEPAscendBuffer

Buffer = DeepEPAscendBuffer if envs.alias_api() == "deep_ep_ascend" else _DeepEPBuffer

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "topk_idx_t"]
