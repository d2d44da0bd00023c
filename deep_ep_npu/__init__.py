"""deep_ep_npu: DeepEP-compatible low-latency expert-parallel communication for Ascend NPUs, runnable anywhere (the
layers: ``docs/architecture.md``). Imports only torch; torch_npu is imported only when the Ascend backend is created."""

from .buffer import Buffer
from .buffer_normal import Config
from .elastic import ElasticBuffer
from .errors import MoeDistributeError
from .handle import EPHandle, EventHandle, EventOverlap, FlatHandle, LowLatencyHandle, topk_idx_t
from .sizes import get_low_latency_ccl_buffer_size
from .transports.failure import EPRankFailure

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
