"""Single-process pieces of the Buffer: fp8 numerics, the typed handle, EventOverlap, -1 mapping, lifetime."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import Buffer, EventOverlap, LowLatencyHandle, topk_idx_t
from deep_ep_npu.backends import InFlight
from deep_ep_npu.backends.ascend_ops import map_no_expert
from deep_ep_npu.quant import FP8_DTYPE, pack_ue8m0, scale_for_fp8_
from tests.support.deepep_utils import calc_diff, fp8_e4m3_reference, per_token_cast_back
from tests.support.distributed import parallel_launch


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's DeepEP fp8 cast (the rows' torch code): scales into a work tensor, then the e4m3 cast."""
    work = torch.empty(x.shape, dtype=torch.float32)
    scale_inv = scale_for_fp8_(work, x, round_scale)
    return work.to(FP8_DTYPE), scale_inv


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_matches_oracle(round_scale):
    x = (torch.randn(64, 1024) * torch.logspace(-3, 2, 64).unsqueeze(1)).to(torch.bfloat16)
    x[3] = 0  # amax clamps at 1e-4
    q, scale_inv = per_token_cast_to_fp8(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (64, 8)
    back = per_token_cast_back(q, scale_inv)
    assert torch.equal(back, fp8_e4m3_reference(x, round_scale))
    assert calc_diff(back, x) < 1e-3
    if round_scale:
        assert torch.equal(torch.exp2(torch.log2(scale_inv).round()), scale_inv)
        packed = pack_ue8m0(scale_inv)
        assert packed.dtype == torch.int32 and packed.shape == (64, 2)
        exponents = packed.contiguous().flatten().view(torch.uint8).to(torch.int32)
        assert torch.equal((exponents << 23).view(torch.float32).view(64, 8), scale_inv)
        assert torch.equal(per_token_cast_back(q, packed), back)


def test_handle_is_deepep_tuple_with_names():
    src_info, layout_range = torch.zeros((2, 8), dtype=torch.int32), torch.tensor([[(3 << 32) | 5, 2]])
    handle = LowLatencyHandle(src_info, layout_range, 4, 128, 4)
    a, b, n, h, e = handle
    assert a is handle[0] is handle.src_info and b is handle[1] is handle.layout_range
    assert (n, h, e) == (4, 128, 4) and len(handle) == 5 and topk_idx_t == torch.int64
    assert handle.recv_begin.tolist() == [[3, 0]] and handle.recv_count_per_rank.tolist() == [[5, 2]]


def test_event_overlap_and_completion():
    calls = []
    completion = InFlight(lambda: calls.append(1))
    event = EventOverlap(completion, (torch.zeros(1),))
    with event:
        assert calls == []
    assert calls == [1] and event.extra_tensors is None
    event.current_stream_wait()
    completion()
    assert calls == [1]  # runs once
    EventOverlap(None).current_stream_wait()

    def boom():
        raise RuntimeError("peer failed")

    failing = InFlight(boom)
    for _ in range(2):  # the first error sticks
        with pytest.raises(RuntimeError, match="peer failed"):
            failing.wait()


def test_map_no_expert():
    idx = torch.tensor([[0, -1, 9, -1], [7, 10, 11, 1]])  # E = 8, caller's zero experts 8..9, copy expert 10, 11
    ids, zero_num = map_no_expert(idx, 8, zero_expert_num=2)
    assert zero_num == 6 and ids.dtype == torch.int32
    assert ids.tolist() == [[0, 11, 9, 13], [7, 14, 15, 1]]


def _lifetime(info):
    keep = Buffer(info.group, backend="reference")
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        keep.destroy()
    buffer = Buffer(info.group, explicitly_destroy=True, backend="reference")
    buffer.destroy()
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.low_latency_dispatch(torch.zeros((1, 128)), torch.zeros((1, 1), dtype=torch.long), 1, 2)
    with pytest.raises(RuntimeError, match="Shrink mode must be enabled"):
        keep.low_latency_clean_mask_buffer()
    return keep.backend_name


def test_lifetime_and_modes():
    assert parallel_launch(2, _lifetime, timeout=60) == ["reference", "reference"]
