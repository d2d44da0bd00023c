"""``DeepEPAscendBuffer``: DeepEP-Ascend's low-latency layout (flat grouped rows, int64 counts, per-token int8 with one
fp32 scale per row) on 2 ranks, against an oracle built from every rank's tokens in plain torch, in its three overlap
styles; its quantization choices and rejections; ``import deep_ep`` giving it under ``DEEP_EP_NPU_ALIAS_API``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deep_ep_npu import MoeDistributeError
from deep_ep_npu.buffer_deepep_ascend import DeepEPAscendBuffer
from tests.support.distributed import parallel_launch

N, H, E, K, T, W = 8, 128, 8, 3, 5, 2
L = E // W
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1  # no expert
    return x, idx, torch.rand((T, K), generator=g)


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8: q = rint(x * 127 / amax) [n, H] int8, scale amax / 127 [n] fp32."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    return torch.round(x.float() * (127 / amax)).to(torch.int8), (amax / 127).flatten()


def _expected(rank: int) -> tuple[torch.Tensor, list[int]]:
    """Rows rank ``rank`` receives, in order (local expert, source rank, source token), and the count per expert."""
    rows, counts = [], []
    for e in range(rank * L, (rank + 1) * L):
        got = [x[t] for x, idx, _ in map(_inputs, range(W)) for t in range(T) if e in idx[t].tolist()]
        rows += got
        counts.append(len(got))
    return torch.stack(rows), counts


def _run(info, quant: str | None, style: str):
    buffer = DeepEPAscendBuffer(info.group, backend="reference")
    x, idx, w = _inputs(info.rank)
    hook_style, async_style = style == "hook", style == "async"
    recv, count, handle, event, hook = buffer.low_latency_dispatch(
        x, idx, N, E, use_fp8=quant is not None, topk_weights=w, async_finish=async_style, return_recv_hook=hook_style
    )
    hook() if hook_style else event.current_stream_wait()
    data, scales = recv if quant else (recv, None)
    n = int(count.sum())
    y = data.float() if scales is None else data.float() * scales[:, None]
    factor = torch.repeat_interleave(torch.arange(L) + 1 + info.rank * L, count)  # expert e: x * (e + 1)
    y[:n] *= factor[:, None]
    out, event, hook = buffer.low_latency_combine(
        y.to(torch.bfloat16), idx, w, handle, async_finish=async_style, return_recv_hook=hook_style
    )
    hook() if hook_style else event.current_stream_wait()
    return data, scales, count, out


def _rank(info):
    results = {
        (quant, style): _run(info, quant, style) for quant in (None, "int8") for style in ("sync", "hook", "async")
    }
    buffer = DeepEPAscendBuffer(info.group, backend="reference")
    x, idx, w = _inputs(info.rank)
    errors = []
    for kw in (dict(use_ue8m0=True), dict(quant_mode="pertoken_fp8_e4m3"), dict(use_mxfp4=True)):
        with pytest.raises(MoeDistributeError) as err:  # rejected on rank 1 only: raised on both
            buffer.low_latency_dispatch(x, idx, N, E, **(kw if info.rank == 1 else {}))
        errors.append(str(err.value))
    return results, errors


def test_deepep_ascend_layout():
    outs = parallel_launch(W, _rank, timeout=120)
    for rank, (results, errors) in enumerate(outs):
        rows, counts = _expected(rank)
        x, idx, w = _inputs(rank)
        weight = torch.where(idx >= 0, w * (idx + 1), 0).sum(dim=1, keepdim=True)  # sum_k w * (e + 1)
        for (quant, style), (data, scales, count, out) in results.items():
            what = f"rank {rank} {quant} {style}"
            assert count.dtype == torch.int64 and count.tolist() == counts, what
            assert data.shape == (N * W * min(K, L), H), what  # DeepEP-Ascend's num_max_tokens rows
            n = len(rows)
            assert not data[n:].any(), what
            if quant is None:
                assert data.dtype == torch.bfloat16 and torch.equal(data[:n], rows), what
                sent = x.float()
            else:
                q, s = _int8(rows)
                assert data.dtype == torch.int8 and scales.shape == (data.shape[0],), what
                assert (data[:n].int() - q.int()).abs().max() <= 1, what  # (a .5 tie may round either way)
                torch.testing.assert_close(scales[:n], s)
                qx, sx = _int8(x)
                sent = qx.float() * sx[:, None]
            want = (sent * weight).to(torch.bfloat16)
            torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-7, msg=what)
        assert all("aborted on every rank: rejected on rank 1" in m for m in errors) if rank == 0 else True
        if rank == 1:
            assert "'mx_fp8_e4m3' (an Ascend 950 mode, not implemented here)" in errors[0], errors
            assert "'pertoken_fp8_e4m3'" in errors[1] and "'mx_fp4_e2m1'" in errors[2], errors


def test_alias_api_picks_the_buffer():
    code = "import deep_ep_npu.alias as a; a.install(); import deep_ep; print(deep_ep.Buffer.__name__)"
    names = []
    for value in ("", "deep_ep", "deep_ep_ascend", "cuda"):
        env = dict(os.environ, DEEP_EP_NPU_ALIAS_API=value, PYTHONPATH=REPO)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        names.append(done.stdout.strip() or done.stderr.strip().splitlines()[-1])
    assert names[:3] == ["Buffer", "Buffer", "DeepEPAscendBuffer"], names
    assert "DEEP_EP_NPU_ALIAS_API: must be 'deep_ep' or 'deep_ep_ascend', got 'cuda'" in names[3], names
