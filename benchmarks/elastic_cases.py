"""The ``ElasticBuffer`` rows of ``bench_low_latency.py``: DeepEP V2's decode-style calls (non-expand layout, no CPU
sync, as vLLM's decode), a fresh dispatch (count exchange + layout) vs one reusing a cached handle (no count
exchange, the layout reused), and combine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deep_ep_npu import ElasticBuffer, profiling

Case = tuple[str, str, Callable[[], object], int, int]


def elastic_cases(group, x: torch.Tensor, topk_idx: torch.Tensor, num_max: int, num_experts: int,
                  dispatch_bytes: int, combine_bytes: int) -> tuple[list[Case], ElasticBuffer]:  # fmt: skip
    """The (op, impl, fn, wire bytes, bytes per selection) cases and the buffer (destroy it after timing)."""
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=num_max, explicitly_destroy=True)
    kwargs = dict(num_experts=num_experts, do_cpu_sync=False)
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx, **kwargs)
    expert_out = recv_x.clone()

    def fresh() -> object:
        return buffer.dispatch(x, topk_idx, **kwargs)

    def cached() -> object:
        return buffer.dispatch(x, handle=handle)

    def combine() -> object:
        return buffer.combine(expert_out, handle)

    fresh()
    wire = profiling.wire_stats(buffer)["dispatch_wire_bytes"]
    combine()
    combine_wire = profiling.wire_stats(buffer)["combine_wire_bytes"]
    cases = [
        ("dispatch", "elastic_fresh", fresh, wire, dispatch_bytes),
        ("dispatch", "elastic_cached", cached, wire, dispatch_bytes),
        ("combine", "elastic", combine, combine_wire, combine_bytes),
    ]
    return cases, buffer
