"""The rest of what code imports from ``deep_ep``: the top-level names, the legacy Buffer's normal-mode surface
(``Config``, ``get_dispatch_layout`` against a loop oracle, ``dispatch`` / ``combine`` pointing to ElasticBuffer)
and ``get_comm_stream``."""

from __future__ import annotations

import pytest
import torch

import deep_ep_npu
from deep_ep_npu import Buffer, Config, ElasticBuffer, EventHandle, EventOverlap, topk_idx_t
from tests.distributed import parallel_launch


def test_top_level_names():
    for name in ("Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "Config", "topk_idx_t"):
        assert name in deep_ep_npu.__all__ and hasattr(deep_ep_npu, name)
    assert topk_idx_t == torch.int64
    EventHandle().current_stream_wait()  # already complete
    assert isinstance(ElasticBuffer.capture(), EventHandle) and isinstance(Buffer.capture(), EventOverlap)
    event = Buffer.capture()  # DeepEP's EventOverlap(EventHandle())
    assert isinstance(event.event, EventHandle)
    with event:
        event.current_stream_wait()
    config = Config(num_sms=24)
    assert config.num_sms == 24 and config.get_nvl_buffer_size_hint(7168 * 2, 8) == 0


def _normal_mode(info):
    r, num_experts = info.world_size, 8
    buffer = Buffer(info.group, backend="reference")
    g = torch.Generator().manual_seed(info.rank)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:3] for _ in range(6)])
    topk_idx[0, :] = -1  # a token with no expert
    topk_idx[1, 2] = -1
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, num_experts)
    event.current_stream_wait()
    want_in_rank = torch.tensor([[any(e >= 0 and e // (num_experts // r) == j for e in row) for j in range(r)]
                                 for row in topk_idx.tolist()])  # fmt: skip
    assert per_rdma is None and in_rank.dtype == torch.bool and torch.equal(in_rank, want_in_rank)
    assert per_rank.dtype == torch.int32 and per_rank.tolist() == want_in_rank.sum(dim=0).tolist()
    assert per_expert.tolist() == [int((topk_idx == e).sum()) for e in range(num_experts)]
    messages = []
    for method in (buffer.dispatch, buffer.combine):
        with pytest.raises(NotImplementedError, match="ElasticBuffer") as err:
            method(torch.zeros((2, 8)), topk_idx=topk_idx)
        messages.append(str(err.value))
    assert buffer.get_comm_stream() is None and isinstance(Buffer.get_dispatch_config(r), Config)
    return messages


def test_normal_mode_surface():
    for messages in parallel_launch(2, _normal_mode, timeout=60):
        assert messages[0].startswith("Buffer.dispatch:") and messages[1].startswith("Buffer.combine:")
