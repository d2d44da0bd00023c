"""DeepEP's LogFMT-10 combine (``Buffer.low_latency_combine(..., use_logfmt=True)``): the codec against a naive
per-element oracle (the nearest representable magnitude), and the combine on 2 ranks against DeepEP's threshold."""

from __future__ import annotations

import math

import torch

from deep_ep_npu import Buffer, MoeDistributeError, logfmt
from tests.support.deepep_utils import calc_diff
from tests.support.distributed import parallel_launch


def _oracle(x: torch.Tensor) -> torch.Tensor:
    """LogFMT-10 by its definition, element by element: per 128-channel group, cast when every magnitude is below 1
    and the (clipped) log range is not empty; a cast value becomes the representable magnitude nearest to it in
    linear terms among ``2^((c - 1) * step + log_amin)``, c = 1..511, or 0 when it is nearer ``2^(log_amin - step)``
    (c = 0) than ``2^log_amin``."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for i, row in enumerate(x.double().view(x.shape[0], -1, 128)):
        for g, group in enumerate(row):
            mags = group.abs().tolist()
            amax, amin = max(mags), min(mags)
            log_amax = math.log2(amax) if amax else -math.inf
            log_amin = max(math.log2(amin) if amin else -math.inf, log_amax - 32)
            if not (log_amax < 0 and log_amin < log_amax):
                out[i, g * 128 : (g + 1) * 128] = group
                continue
            step = (log_amax - log_amin) / 510
            levels = torch.tensor([2 ** ((c - 1) * step + log_amin) for c in range(512)], dtype=torch.float64)
            dist = (levels.unsqueeze(0) - group.abs().unsqueeze(1)).abs()  # [128, 512]
            best = dist.min(dim=1, keepdim=True).values
            c = torch.where(dist == best, torch.arange(512), -1).amax(dim=1)  # ties: the larger level
            out[i, g * 128 : (g + 1) * 128] = torch.where(c == 0, 0.0, levels[c] * group.sign())
    return out


def test_codec_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn((3, 256), generator=g) * s for s in (0.05, 0.4, 3.0)]  # cast, cast, not cast (amax >= 1)
    tiny = torch.randn((1, 256), generator=g) * 1e-3
    tiny[0, :8] = 0.0  # zeros decode to 0
    x = torch.cat([*rows, tiny]).to(torch.bfloat16)
    packed = logfmt.encode(x)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (x.shape[0], logfmt.row_bytes(256))
    got, want = logfmt.decode(packed, 256).double(), _oracle(x)
    assert torch.equal(got[6:9], x[6:9].double())  # groups with amax >= 1 travel as bf16
    close = (got - want).abs() <= 1e-6 * want.abs()
    assert close.float().mean() > 0.999, "more than rare near-ties differ from the nearest level"
    assert torch.equal(got[9, :8], torch.zeros(8, dtype=torch.float64))
    rel = ((got - x.double()).abs() / x.double().abs().clamp(min=1e-30))[:6]
    assert float(rel.max()) < 2 ** (32 / 510 / 2) - 1 + 1e-3  # at most half a step (in log2) of 32 / 510


N, H, E, K = 8, 512, 8, 3


def _combine(info):
    buffer = Buffer(info.group, backend="reference")
    g = torch.Generator().manual_seed(info.rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    idx[0, 1] = -1
    w = torch.rand((N, K), generator=g)
    out = {}
    for scale in (0.05, 0.2, 2.0):  # DeepEP's pattern: randn * 0.5 * random: groups with amax < 1 cast, the others not
        x = (torch.randn((N, H), generator=g) * scale).to(torch.bfloat16)
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        plain, _, _ = buffer.low_latency_combine(recv_x, idx, w, handle)
        combined, _, _ = buffer.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)
        want = (x.float() * w.masked_fill(idx == -1, 0).sum(dim=1, keepdim=True)).to(torch.bfloat16)
        oracle = (_oracle(x) * w.masked_fill(idx == -1, 0).sum(dim=1, keepdim=True).double()).float()
        out[scale] = (
            calc_diff(want, combined),
            torch.equal(plain, combined),
            bool(torch.allclose(combined.float(), oracle, rtol=1e-2, atol=1e-3)),
        )
    try:
        buffer.low_latency_combine(recv_x.float(), idx, w, handle, use_logfmt=True)
    except MoeDistributeError as err:
        out["fp32"] = err.param
    return out


def test_logfmt_combine():
    for res in parallel_launch(2, _combine, timeout=60):
        for scale in (0.05, 0.2, 2.0):
            diff, same_as_plain, matches_oracle = res[scale]
            assert diff < 1e-5 and matches_oracle, (scale, diff)
            assert same_as_plain == (scale == 2.0)  # cast groups are lossy; amax >= 1 everywhere travels as bf16
        assert res["fp32"] == "use_logfmt"
