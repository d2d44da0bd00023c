"""What ``import deep_ep`` gives after :func:`deep_ep_npu.alias.install` (with no DeepEP installed): DeepEP's public
names, this library's implementations."""

from __future__ import annotations

from .. import Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, topk_idx_t
from .. import __version__ as __version__

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "topk_idx_t"]
