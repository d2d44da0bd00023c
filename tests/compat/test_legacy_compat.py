"""The rest of what code imports from ``deep_ep``: the top-level names, the legacy Buffer's normal-mode surface
(``Config`` with DeepEP's checks and size hints, ``get_dispatch_layout`` against a loop oracle; ``dispatch`` /
``combine``: tests/compat/test_normal_mode.py) and ``get_comm_stream``."""

from __future__ import annotations

import pytest
import torch

import deep_ep_npu
from deep_ep_npu import Buffer, Config, ElasticBuffer, EventHandle, EventOverlap, topk_idx_t
from tests.support.distributed import parallel_launch


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
    assert config.num_sms == 24 and config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0


def _normal_mode(info):
    r, num_experts = info.world_size, 8
    buffer = Buffer(info.group, backend="reference")
    g = torch.Generator().manual_seed(info.rank)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:3] for _ in range(6)])
    topk_idx[0, :] = -1  # a token with no expert
    topk_idx[1, 2] = -1
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, num_experts)
    event.current_stream_wait()
    want_in_rank = torch.tensor(
        [[any(e >= 0 and e // (num_experts // r) == j for e in row) for j in range(r)] for row in topk_idx.tolist()]
    )
    assert per_rdma is None and in_rank.dtype == torch.bool and torch.equal(in_rank, want_in_rank)
    assert per_rank.dtype == torch.int32 and per_rank.tolist() == want_in_rank.sum(dim=0).tolist()
    assert per_expert.tolist() == [int((topk_idx == e).sum()) for e in range(num_experts)]
    assert buffer.get_comm_stream() is None and isinstance(Buffer.get_dispatch_config(r), Config)
    return True


def test_normal_mode_surface():
    assert all(parallel_launch(2, _normal_mode, timeout=60))


def test_config_rules_and_hints():
    """DeepEP's Config checks and size hints (its formulas, e.g. 7168-wide bf16 rows on 8 and 16 ranks)."""
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        Config(20, 256, 256)
    with pytest.raises(ValueError, match="num_max_rdma_chunked_send_tokens"):
        Config(20, 6, 256, 200, 100)
    assert Config(24, 8, 256, 16, 130).num_max_rdma_chunked_recv_tokens == 144  # rounded up as DeepEP's
    config = Config(24, 6, 256, 6, 128)
    channels, per_token = 12, 7168 * 2 + 8 + 128 * 12 + 128 * 4
    assert (
        config.get_nvl_buffer_size_hint(7168 * 2, 8)
        == -(-(channels * 8 * 5 * 4 + channels * 8 * 256 * per_token) // 128) * 128
    )
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    rdma = channels * 2 * 18 * 2 * 4 + channels * 2 * 132 * (per_token + 16) * 2  # (128 rounded up to 6's multiple)
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) == -(-rdma // 128) * 128
    assert Buffer.get_dispatch_config(8) == Config(Buffer.num_sms, 6, 256, 6, 128)
    assert Buffer.get_combine_config(2) == Config(Buffer.num_sms, 10, 256, 6, 128)
    with pytest.raises(ValueError, match="unsupported number of EP ranks 3"):
        Buffer.get_dispatch_config(3)
