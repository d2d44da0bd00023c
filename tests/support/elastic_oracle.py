"""Single-process references for DeepEP V2's ``ElasticBuffer`` (the computations of DeepEP's ``tests/elastic/
test_ep.py`` and its reference module, written anew). Every rank builds every rank's inputs from seeds, so the
references need no communication and share no code with the library."""

from __future__ import annotations

import math

import torch

SEED = 0  # the test's global seed (enters the pre-combine data as sin(SEED))


def rank_inputs(rank: int, num_max: int, hidden: int, num_topk: int, num_experts: int, seed: int, fp8: bool):
    """Rank ``rank``'s (x, topk_idx, topk_weights): ``T = max(1, N - rank)`` tokens, uniform scores, ``topk`` not
    sorted, about 1 in 8 entries masked to -1 (weight 0). x is bf16, or ``(float8_e4m3fn, fp32 amax / 448 per 128
    channels)`` with ``fp8``."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    num_tokens = max(1, num_max - rank)
    scores = torch.rand((num_tokens, num_experts), generator=g)
    topk_weights, topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False)
    masked = torch.rand((num_tokens, num_topk), generator=g) < 0.125
    topk_idx = topk_idx.masked_fill(masked, -1)
    topk_weights = topk_weights.masked_fill(masked, 0.0)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16)
    return (cast_to_fp8(x) if fp8 else x), topk_idx, topk_weights


def cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel e4m3: data `[T, H]` float8_e4m3fn, scales `[T, H / 128]` fp32 (amax / 448)."""
    t, h = x.shape
    groups = x.float().view(t, h // 128, 128)
    scale = groups.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (groups / scale.unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn), scale


def reference_dispatch(inputs: list, rank: int, num_max: int, num_experts: int) -> dict:
    """What ``rank`` receives, non-expand, ordered by (source rank, token): x (and sf), local ids (-1: not here),
    the full weight rows, ``src = source * N + token``, and the tokens per source."""
    num_local = num_experts // len(inputs)
    lo, hi = rank * num_local, (rank + 1) * num_local
    xs, sfs, ids, ws, srcs, per_rank = [], [], [], [], [], []
    for s, (x, idx, w) in enumerate(inputs):
        here = (idx >= lo) & (idx < hi)
        tokens = here.any(dim=1).nonzero().flatten()
        data, sf = x if isinstance(x, tuple) else (x, None)
        xs.append(data[tokens])
        if sf is not None:
            sfs.append(sf[tokens])
        ids.append(torch.where(here[tokens], idx[tokens] - lo, -1))
        ws.append(w[tokens])
        srcs.append(s * num_max + tokens)
        per_rank.append(int(tokens.numel()))
    x_out = torch.cat(xs) if not sfs else (torch.cat(xs), torch.cat(sfs))
    return dict(
        x=x_out,
        topk_idx=torch.cat(ids),
        topk_weights=torch.cat(ws),
        src=torch.cat(srcs).int(),
        num_recv_per_rank=per_rank,
    )


def pre_combine_data(src: torch.Tensor, num_ranks: int, num_max: int, num_topk: int, hidden: int) -> torch.Tensor:
    """`[n, K, hidden]` bf16 expert outputs of tokens ``src`` (source * N + token): for slot j,
    ``sin(((src * K + j) * 131071 % (R * N * K) + 1) / (R * N * K) * (h + 1) + sin(SEED))``."""
    seeds = src.long().unsqueeze(1) * num_topk + torch.arange(num_topk).unsqueeze(0)
    period = num_ranks * num_max * num_topk
    phase = ((seeds * 131071 % period).float() + 1) / period
    channels = torch.arange(1, hidden + 1, dtype=torch.float32)
    return torch.sin(phase.unsqueeze(-1) * channels + math.sin(SEED)).to(torch.bfloat16)


def ordered_sum(rows: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """`[n, K, H]` summed over K in slot order in fp32 (from ``start`` fp32, else 0), rounded to the dtype once."""
    acc = torch.zeros((rows.shape[0], rows.shape[2])) if start is None else start.clone()
    for j in range(rows.shape[1]):
        acc += rows[:, j].float()
    return acc.to(rows.dtype)


def reference_combine(
    y: torch.Tensor, topk_idx: torch.Tensor, num_local: int, bias, reduce_per_rank: bool, bias_last: bool = False
) -> torch.Tensor:
    """A token's slots ``y`` `[T, K, H]` (0 where ``topk_idx`` is -1) reduced as DeepEP's direct combine does:
    with ``reduce_per_rank``, each rank's slots are first summed in slot order (fp32, rounded to bf16) into the
    rank's last slot; then every slot is added in slot order to ``bias0 + bias1`` (fp32) and rounded once
    (``bias_last``: the bias is added after the slots instead, the Ascend combine's order)."""
    y = y.clone()
    if reduce_per_rank:
        owner = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
        for t in range(y.shape[0]):
            for group in owner[t].unique().tolist():
                slots = (owner[t] == group).nonzero().flatten().tolist()
                acc = torch.zeros(y.shape[2])
                for j in slots:
                    acc += y[t, j].float()
                y[t, slots] = 0
                y[t, slots[-1]] = acc.to(y.dtype)
    biases = bias if isinstance(bias, tuple) else () if bias is None else (bias,)
    start = None
    for b in biases:
        start = b.float() if start is None else start + b.float()
    if bias_last and start is not None:
        acc = torch.zeros((y.shape[0], y.shape[2]))
        for j in range(y.shape[1]):
            acc += y[:, j].float()
        return (acc + start).to(y.dtype)
    return ordered_sum(y, start)


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
