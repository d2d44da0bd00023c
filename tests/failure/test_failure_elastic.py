"""Shrink-mode masks on the ascend backend become the ops' ``elastic_info`` (contract test, no NPU).

``deep_ep_npu.sim`` (installed by ``tests/backends/test_ascend_backend.py``'s ``_install_sim``, which records the
arguments) computes the ops with the reimplementation in ``deep_ep_npu.ops`` (which implements ``elastic_info``).
With rank 1 masked on every rank, the ascend backend must produce what the reference backend produces with the
same mask: the same rows per (local expert, source rank) and the same combined output, and it must pass the
documented ``elastic_info`` layout with expert ids renumbered over the live ranks.
"""

from __future__ import annotations

import torch

from deep_ep_npu import Buffer
from deep_ep_npu.backends.ascend import elastic_info_from_mask, remap_expert_ids
from tests.backends.test_ascend_backend import E, K, N, _inputs, _install_sim, _run
from tests.support.distributed import parallel_launch

MASKED = 1


def _blocks(recv_count, layout_range, rows, src):
    """{(local expert, source rank): rows sorted by source token}: independent of the block order in an expert."""
    out = {}
    for i in range(layout_range.shape[0]):
        for j in range(layout_range.shape[1]):
            begin, count = int(layout_range[i, j]) >> 32, int(layout_range[i, j]) & 0xFFFFFFFF
            tokens = src[i][begin : begin + count]
            order = torch.argsort(tokens)
            out[(i, j)] = (tokens[order], rows[i][begin : begin + count][order])
        assert sum(int(layout_range[i, j]) & 0xFFFFFFFF for j in range(layout_range.shape[1])) == int(recv_count[i])
    return out


def _masked_parity(info):
    calls: list = []
    _install_sim(calls)
    ref = Buffer(info.group, backend="reference", enable_shrink=True)
    npu = Buffer(info.group, backend="ascend", ccl_buffer_size=64, enable_shrink=True)
    for buf in (ref, npu):
        buf.low_latency_update_mask_buffer(MASKED, True)
    x, topk_idx, weights = _inputs(info.rank, [N, 5, 3, N][info.rank])
    a = _run(ref, x, topk_idx, weights, False, False, False)
    b = _run(npu, x, topk_idx, weights, False, False, False)
    assert torch.equal(a[0], b[0])
    blocks_a, blocks_b = _blocks(a[0], a[1], a[2], a[4]), _blocks(b[0], b[1], b[2], b[4])
    for key, (tokens, rows) in blocks_a.items():
        assert torch.equal(tokens, blocks_b[key][0]) and torch.equal(rows, blocks_b[key][1]), key
    assert torch.allclose(a[5].float(), b[5].float(), atol=1e-2, rtol=1e-2)
    if info.rank == MASKED or not len(x):
        assert not bool(a[5].any())
    dispatch = [kw for name, kw in calls if name == "dispatch"][0]
    combine = [kw for name, kw in calls if name == "combine"][0]
    num_local = E // info.world_size
    want = [1, 3, 0, 3 * num_local, 0, -1, 1, 2, 0, 2, 3, -1]
    for kw in (dispatch, combine):
        assert kw["elastic_info"][0] == torch.int32 and kw["elastic_info"][2].tolist() == want
        assert kw["moe_expert_num"] == E and kw["zero_expert_num"] == K  # K zero experts after the E' live ones
    assert int(dispatch["expert_ids"][2].max()) < 3 * num_local + K
    return int(a[0].sum())


def test_mask_drives_elastic_info_on_the_ascend_backend():
    received = parallel_launch(4, _masked_parity, timeout=90)
    assert received[MASKED] == 0 and sum(received) > 0


def test_elastic_info_from_mask_and_id_remap():
    mask = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    assert elastic_info_from_mask(torch.zeros(4, dtype=torch.int32), 2) is None
    info = elastic_info_from_mask(mask, 2)
    assert info.tolist() == [1, 2, 0, 4, 0, -1, 1, -1, 0, 2, -1, -1]
    ids = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6], [7, -1, -1, -1]])
    # experts 2, 3 (rank 1) and 6, 7 (rank 3) are absent; rank 2's experts 4, 5 become 2, 3
    assert remap_expert_ids(ids, info, 2).tolist() == [[0, 1, -1, -1], [-1, 2, 3, -1], [-1, -1, -1, -1]]
    try:
        elastic_info_from_mask(torch.ones(4, dtype=torch.int32), 2)
    except ValueError as err:
        assert "every rank is masked" in str(err)
    else:
        raise AssertionError("an all-masked EP must be refused")
