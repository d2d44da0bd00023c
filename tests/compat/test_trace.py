"""How many library files one call runs through: a dispatch and a combine, traced with ``sys.setprofile`` (the
distinct files of ``deep_ep_npu`` whose Python functions run, C calls and torch excluded), touch at most
:data:`MAX_FILES` files each (per front-end), for ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` (bf16
and fp8, both transports) and ``ops.moe_distribute_dispatch_v2`` / ``moe_distribute_combine_v2`` (a warm call: the
second of two, so one-time setup such as a group's first collective does not count)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from tests.support.distributed import parallel_launch

MAX_FILES = {"Buffer": 9, "ops": 10}  # (the goal: 8 for both)


def _files(call: Callable[[], object]) -> list[str]:
    import deep_ep_npu

    root, seen = os.path.dirname(deep_ep_npu.__file__), set()

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, root))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def _trace(info):
    from deep_ep_npu import Buffer
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2

    g = torch.Generator().manual_seed(info.rank)
    x, w = torch.randn((8, 256), generator=g).bfloat16(), torch.rand((8, 2), generator=g)
    idx = torch.randint(0, 8, (8, 1), generator=g)
    idx = torch.cat([idx, (idx + 1) % 8], dim=1)
    out, got = {}, {}
    for transport in ("shm", "collective"):
        buffer = Buffer(info.group, transport=transport)
        for fp8 in (False, True):
            for _ in range(2):
                dispatch = _files(lambda b=buffer, f=fp8: got.update(d=b.low_latency_dispatch(x, idx, 8, 8, use_fp8=f)))
                recv_x, _, handle, _, _ = got["d"]
                y = recv_x if not fp8 else (recv_x[0].float() * recv_x[1].repeat_interleave(128, -1)).bfloat16()
                combine = _files(lambda: buffer.low_latency_combine(y, idx, w, handle))  # noqa: B023
            out[f"Buffer {transport} fp8={fp8}"] = (dispatch, combine)
    for _ in range(2):
        dispatch = _files(lambda: got.update(o=moe_distribute_dispatch_v2(x, idx.int(), info.group, 2, info.rank, 8)))
        o = got["o"]
        combine = _files(
            lambda o=o: moe_distribute_combine_v2(o[0], idx.int(), o[2], o[4], w, info.group, 2, info.rank, 8)
        )
    out["ops"] = (dispatch, combine)
    return out


def test_a_call_runs_through_few_files():
    traced = parallel_launch(2, _trace, timeout=120)[0]
    for name, (dispatch, combine) in traced.items():
        bound = MAX_FILES[name.split()[0]]
        assert len(dispatch) <= bound, (name, "dispatch", " ".join(dispatch))
        assert len(combine) <= bound, (name, "combine", combine)
