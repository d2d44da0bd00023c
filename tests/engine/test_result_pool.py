"""The engine's result pool (:class:`deep_ep_npu.engine.exchange.ResultPool`): a result's memory is reused only once
every tensor and view of it is gone, never while one is alive; small and non-CPU results are plain tensors."""

from __future__ import annotations

import torch

from deep_ep_npu.engine.exchange import ResultPool

CPU = torch.device("cpu")


def test_memory_is_reused_only_after_every_view_is_gone():
    pool = ResultPool()
    a = pool.take((1024, 1024), torch.bfloat16, CPU, False)
    view = a[3:5]
    ptr = a.data_ptr()
    del a
    b = pool.take((1024, 1024), torch.bfloat16, CPU, False)
    assert b.data_ptr() != ptr  # a view of the first result is alive
    view.fill_(1.0)
    assert not b.eq(1.0).all()  # and writing it does not touch the new result
    del view
    c = pool.take((1000, 1024), torch.bfloat16, CPU, True)
    assert c.data_ptr() == ptr and c.shape == (1000, 1024) and c.dtype == torch.bfloat16
    assert c.eq(0).all()  # zeros=True zero-fills reused memory
    assert b.data_ptr() != c.data_ptr()


def test_sizes_and_bound():
    pool = ResultPool()
    small = pool.take((4, 4), torch.float32, CPU, True)
    assert small.eq(0).all() and not pool.blocks  # below min_bytes: not pooled
    big = pool.take((1 << 20,), torch.float32, CPU, False)
    ptr = big.data_ptr()
    del big
    assert pool.take((1 << 18,), torch.float32, CPU, False).data_ptr() != ptr  # less than half the block: a new one
    held = [pool.take((1 << 18, 2), torch.float32, CPU, False) for _ in range(2 * pool.max_blocks)]
    assert len(pool.blocks) == pool.max_blocks and len({t.data_ptr() for t in held}) == len(held)
