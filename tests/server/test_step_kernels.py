"""The batched kernels of a step against plain per-sequence / per-expert loops written here: paged attention (GQA,
mixed decode and prefill chunks, interleaved block tables, sliding window, attention sinks) and the grouped expert
matmuls (against each expert's own matmuls, and against the loop the other devices take)."""

from __future__ import annotations

import math

import pytest
import torch

from deep_ep_npu import kernels
from server.models import ForwardBatch, LocalComm, ModelConfig, SeqInput
from server.models.moe import LocalExperts, per_expert, swiglu, use_grouped_mm
from server.models.paged_attention import paged_attention, write_kv
from server.random_model import random_hf_config

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence in float64: q `[n, heads, d]` at positions start.., k/v `[start + n, kv_heads, d]`."""
    out = torch.empty(q.shape[0], HEADS, v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = start + i
        keys = [j for j in range(pos + 1) if window is None or j > pos - window]
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            logits = [float(q[i, h].double() @ k[j, kv].double()) * scale for j in keys]
            top = max(logits + ([float(sinks[h])] if sinks is not None else []))
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
            out[i, h] = sum(w / total * v[j, kv].double() for w, j in zip(weights, keys, strict=True))
    return out


# (cached tokens, new tokens): decodes and prefill chunks, one starting mid-block, one at position 0; decodes alone
MIXED, DECODES = [(9, 1), (0, 7), (3, 1), (5, 6), (0, 1)], [(9, 1), (3, 1), (0, 1), (14, 1)]


@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (5, False), (None, True), (3, True)])
@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_paged_attention_matches_per_sequence_attention(
    window: int | None, with_sinks: bool, shapes: list[tuple[int, int]]
) -> None:
    torch.manual_seed(0)
    num_blocks = 32
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    order = torch.randperm(num_blocks).tolist()  # block tables scattered over the cache
    tables = [order[6 * i : 6 * i + 6] for i in range(len(shapes))]
    history = [(torch.randn(c, KV_HEADS, DIM), torch.randn(c, KV_HEADS, DIM)) for c, _ in shapes]
    for (k, v), table in zip(history, tables, strict=True):  # what earlier steps wrote
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k.shape[0])], dtype=torch.int64)
        write_kv(k_cache, slots, k)
        write_kv(v_cache, slots, v)
    seqs = [SeqInput(table, c, [0] * n) for (c, n), table in zip(shapes, tables, strict=True)]
    batch = ForwardBatch.build(seqs, BLOCK)
    expect = [(3, 1), (2, 7)] if shapes is MIXED else [(4, 1)]  # decodes, then the chunks padded to 7
    assert [g.rows.shape for g in batch.groups] == expect
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, HEADS, DIM)
    k, v = torch.randn(num_tokens, KV_HEADS, DIM), torch.randn(num_tokens, KV_HEADS, DIM)
    write_kv(k_cache, batch.slot_mapping, k)
    write_kv(v_cache, batch.slot_mapping, v)
    sinks = torch.randn(HEADS) if with_sinks else None
    out = paged_attention(q, k_cache, v_cache, batch, DIM**-0.5, window=window, sinks=sinks)
    row = 0
    for (cached, n), (hk, hv) in zip(shapes, history, strict=True):
        rows = slice(row, row + n)
        ref = naive_attention(
            q[rows], torch.cat((hk, k[rows])), torch.cat((hv, v[rows])), cached, DIM**-0.5, window, sinks
        )
        torch.testing.assert_close(out[rows].double(), ref, atol=1e-5, rtol=0)
        row += n


@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss"])
@torch.inference_mode()  # as the model's forward
def test_grouped_experts_match_each_experts_matmuls(architecture: str) -> None:
    """Router output -> LocalComm's grouped layout -> grouped matmuls -> combine equals, token by token, the sum over
    its experts of each expert's own FFN; the per-expert loop (and its matrix-vector products) gives the same rows.
    gpt-oss: with the experts' biases and the clamped SwiGLU on every path."""
    torch.manual_seed(0)
    num_experts, hidden, inter, num_topk, num_tokens = 6, 16, 8, 3, 10
    spec = {
        "architecture": architecture,
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_experts": num_experts,
        "num_experts_per_tok": num_topk,
    }
    cfg = ModelConfig.from_hf(random_hf_config(spec))
    experts = LocalExperts(cfg, num_experts)
    assert hasattr(experts, "b13") == (architecture == "gpt_oss")
    experts.w13.normal_()
    experts.w2.normal_()
    b13, b2 = (experts.b13.normal_(), experts.b2.normal_()) if hasattr(experts, "b13") else (None, None)
    x = torch.randn(num_tokens, hidden)
    topk_idx = torch.stack([torch.randperm(num_experts)[:num_topk] for _ in range(num_tokens)])
    topk_idx[3, 1] = -1  # a slot without an expert contributes nothing
    weights = torch.rand(num_tokens, num_topk)
    comm = LocalComm(num_experts, num_tokens)
    rows, offsets, handle = comm.dispatch(x, topk_idx)
    assert use_grouped_mm(rows, num_experts) and not use_grouped_mm(rows[:num_experts], num_experts)
    grouped = experts(rows, offsets)
    valid = int(offsets[-1])
    looped = per_expert(rows, offsets, experts._expert)  # the loop of sparse steps, other devices and int8 experts
    torch.testing.assert_close(looped[:valid], grouped[:valid], atol=1e-5, rtol=1e-5)
    one_row = experts(rows[:1], torch.ones_like(offsets))  # one row of expert 0: a matrix-vector product
    torch.testing.assert_close(one_row[0], grouped[0], atol=1e-5, rtol=1e-5)
    out, _ = comm.combine(grouped, topk_idx, weights, handle)
    for t in range(num_tokens):
        want = torch.zeros(hidden)
        for j, e in enumerate(topk_idx[t].tolist()):
            if e >= 0:
                h = experts.w13[e] @ x[t] + (0 if b13 is None else b13[e])
                y = experts.w2[e] @ swiglu(h[:inter], h[inter:], cfg) + (0 if b2 is None else b2[e])
                want += weights[t, j] * y
        torch.testing.assert_close(out[t], want, atol=1e-4, rtol=1e-4)
    grouped[valid:] = float("nan")  # the pair without an expert: its row is never read
    for dtype in (torch.float32, torch.bfloat16):  # the CPU kernel's weighted sum is torch's index_add_, bit for bit
        fast, _ = comm.combine(grouped.to(dtype), topk_idx, weights, handle)
        with kernels.disabled():
            slow, _ = comm.combine(grouped.to(dtype), topk_idx, weights, handle)
        assert fast.dtype == dtype and torch.equal(fast, slow) and not fast.isnan().any()
