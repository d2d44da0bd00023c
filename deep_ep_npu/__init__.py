"""deep_ep_npu: DeepEP-compatible low-latency expert-parallel communication for Ascend NPUs, runnable anywhere.

Imports only torch; torch_npu is imported only when the Ascend backend is created.
"""

from .buffer import Buffer
from .elastic import ElasticBuffer
from .ep_handle import EPHandle
from .event import EventHandle, EventOverlap
from .failure import EPRankFailure
from .handle import FlatHandle, LowLatencyHandle, topk_idx_t
from .normal_mode import Config
from .ops import MoeDistributeError, get_low_latency_ccl_buffer_size

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "EPHandle",
    "EPRankFailure",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "FlatHandle",
    "LowLatencyHandle",
    "MoeDistributeError",
    "__version__",
    "get_low_latency_ccl_buffer_size",
    "topk_idx_t",
]
