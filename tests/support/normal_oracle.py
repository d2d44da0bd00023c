"""An independent oracle of DeepEP's normal mode (``Buffer.dispatch`` / ``combine``), written from DeepEP's semantics
with plain loops over every rank's inputs (no deep_ep_npu code): what rank ``me`` receives and what each source gets
back from a combine."""

from __future__ import annotations

import torch


def inputs(rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int, seed: int):
    """Rank ``rank``'s (x bf16, topk_idx int64 with some -1, topk_weights fp32), reproducible on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16)
    scores = torch.randn((num_tokens, num_experts), generator=g).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1).indices
    for t in range(0, num_tokens, 3):  # some empty slots, one token with no expert at all
        topk_idx[t, t % num_topk] = -1
    if num_tokens > 1:
        topk_idx[1, :] = -1
    return x, topk_idx, torch.rand((num_tokens, num_topk), generator=g)


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]) by loops."""
    num_local = num_experts // num_ranks
    rows = topk_idx.tolist()
    in_rank = torch.tensor(
        [[any(e >= 0 and e // num_local == r for e in row) for r in range(num_ranks)] for row in rows], dtype=torch.bool
    ).view(len(rows), num_ranks)
    per_expert = torch.tensor([sum(row.count(e) for row in rows) for e in range(num_experts)], dtype=torch.int32)
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


def received(me: int, all_x, all_idx, all_w, num_experts: int, num_ranks: int):
    """Rank ``me``'s rows in DeepEP's order (source rank, then token): (sources [(rank, token)], x rows, local ids,
    weights with 0 where the slot's expert is elsewhere)."""
    num_local, src, xs, ids, ws = num_experts // num_ranks, [], [], [], []
    for p in range(num_ranks):
        for t, row in enumerate(all_idx[p].tolist()):
            if not any(e >= 0 and e // num_local == me for e in row):
                continue
            src.append((p, t))
            xs.append(all_x[p][t])
            local = [e - me * num_local if e >= 0 and e // num_local == me else -1 for e in row]
            ids.append(local)
            ws.append([float(all_w[p][t, k]) if v >= 0 else 0.0 for k, v in enumerate(local)])
    hidden = all_x[0].shape[1]
    x = torch.stack(xs) if xs else torch.empty((0, hidden), dtype=all_x[0].dtype)
    return (
        src,
        x,
        torch.tensor(ids, dtype=torch.int64).view(-1, all_idx[0].shape[1]),
        torch.tensor(ws).view(-1, all_idx[0].shape[1]),
    )


def recv_list(me: int, all_idx, num_experts: int, num_ranks: int, alignment: int) -> list[int]:
    num_local = num_experts // num_ranks
    counts = [sum(int((idx == me * num_local + i).sum()) for idx in all_idx) for i in range(num_local)]
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def combined(me: int, num_tokens: int, rows_of, bias: tuple[torch.Tensor, ...], dtype: torch.dtype):
    """What rank ``me`` gets back: ``rows_of[q]`` is rank q's (sources, y rows); per token, in fp32, the biases, then
    the rows by rank ascending, rounded once to ``dtype``."""
    hidden = rows_of[0][1].shape[1]
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    for t in range(num_tokens):
        acc = torch.zeros((hidden,), dtype=torch.float32)
        for b in bias:
            acc = acc + b[t].float()
        for src, y in rows_of:
            for i, (p, tok) in enumerate(src):
                if p == me and tok == t:
                    acc = acc + y[i].float()
        out[t] = acc
    return out.to(dtype)
