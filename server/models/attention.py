"""Attention with a per-slot KV cache: GQA (Qwen3-MoE with q/k norm, Mixtral) and MLA (DeepSeek-V3).

A forward step runs a flat batch of tokens from several sequences (decode tokens and prefill chunks mixed).
Projections run over the whole batch; the attention itself runs per sequence against its cache slot, so a
sequence's result does not depend on which other sequences share the step (batch invariance).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm
from .qkv import QKVProjections, token_seq_lens
from .rope import Rotary


@dataclasses.dataclass
class SeqChunk:
    """One sequence's tokens in a step: rows ``[row, row + num_tokens)`` of the flat batch, written to cache
    ``slot`` at positions ``[start, start + num_tokens)``."""

    slot: int
    start: int
    num_tokens: int
    row: int


@dataclasses.dataclass
class ForwardBatch:
    """A flat batch for one step.

    Arguments:
        input_ids: `[num_tokens]` with `torch.int64`.
        positions: `[num_tokens]` with `torch.int64`, the position of each token in its sequence.
        seqs: the sequences, in row order.
        sample_rows: `[num_rows]` with `torch.int64`, rows whose logits the step returns.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqChunk]
    sample_rows: torch.Tensor

    @classmethod
    def build(
        cls,
        chunks: list[tuple[int, int, list[int]]],
        sample: list[bool],
        device: torch.device | str = "cpu",
        all_logits: list[bool] | None = None,
    ) -> ForwardBatch:
        """From ``(slot, start, token_ids)`` per sequence; ``sample[i]`` asks for the logits of its last token,
        ``all_logits[i]`` for those of every token of the chunk (in order; e.g. for prompt log-probabilities). The
        index tensors are made on ``device`` (the model's)."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqChunk] = []
        rows: list[int] = []
        every = all_logits or [False] * len(chunks)
        for (slot, start, tokens), want, want_all in zip(chunks, sample, every, strict=True):
            seqs.append(SeqChunk(slot, start, len(tokens), len(ids)))
            if want_all:
                rows.extend(range(len(ids), len(ids) + len(tokens)))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            if want and not want_all:
                rows.append(len(ids) - 1)
        as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_long(ids), as_long(positions), seqs, as_long(rows))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q `[n, heads, d]`, k/v `[start + n, kv_heads, d]` -> `[n, heads, d_v]` (causal, GQA by head groups).
    ``window``: attend only the last ``window`` positions (the query's own included); ``sinks`` `[heads]`: a logit
    per head that joins each softmax denominator (gpt-oss)."""
    n, length = q.shape[0], k.shape[0]
    key_pos, query_pos = torch.arange(length, device=q.device), start + torch.arange(n, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0])
        return out.transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = ((q.float() @ k.float().transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype).transpose(0, 1)


class GQAttention(QKVProjections):
    """Grouped-query attention with HF's parameter names (``q_proj``/``k_proj``/``v_proj``/``o_proj``,
    optional ``q_norm``/``k_norm``: :class:`~server.models.qkv.QKVProjections`). Cache per layer: k and v, each
    ``[slots, max_len, kv_heads, head_dim]``."""

    def cache_shapes(self) -> list[tuple[int, ...]]:
        return [(self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x, batch)
        k_cache, v_cache = cache
        out = torch.empty_like(q)
        for s in batch.seqs:
            rows, end = slice(s.row, s.row + s.num_tokens), s.start + s.num_tokens
            k_cache[s.slot, s.start : end] = k[rows]
            v_cache[s.slot, s.start : end] = v[rows]
            out[rows] = _attend(q[rows], k_cache[s.slot, :end], v_cache[s.slot, :end], s.start, self.head_dim**-0.5,
                                self.window, getattr(self, "sinks", None))  # fmt: skip
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention with HF's parameter names. The cache holds the compressed latent
    (after ``kv_a_layernorm``) ``[slots, max_len, kv_lora_rank]`` and the rotated shared key
    ``[slots, max_len, qk_rope_head_dim]``; keys and values are expanded through ``kv_b_proj`` when attending."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=cfg.o_bias)
        self.rotary = Rotary(cfg.rope, interleave=cfg.rope_interleave)
        mscale = cfg.rope.mla_mscale()  # YaRN: the softmax scale gains mscale^2 (as transformers)
        self.scale = qk**-0.5 * mscale * mscale

    def cache_shapes(self) -> list[tuple[int, ...]]:
        return [(self.kv_lora_rank,), (self.rope,)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype, token_seq_lens(batch, self.rotary))
        q_rot = self.rotary.apply(q[..., self.nope :], cos, sin)
        q = torch.cat((q[..., : self.nope], q_rot), dim=-1)
        k_rot = self.rotary.apply(k_rot[:, None, :], cos, sin)[:, 0]
        lat_cache, rot_cache = cache
        out = x.new_empty(t, self.num_heads, self.v_dim)
        for s in batch.seqs:
            rows, end = slice(s.row, s.row + s.num_tokens), s.start + s.num_tokens
            lat_cache[s.slot, s.start : end] = latent[rows]
            rot_cache[s.slot, s.start : end] = k_rot[rows]
            kv = self.kv_b_proj(lat_cache[s.slot, :end]).view(end, self.num_heads, self.nope + self.v_dim)
            k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
            k = torch.cat((k_nope, rot_cache[s.slot, :end, None, :].expand(end, self.num_heads, self.rope)), dim=-1)
            out[rows] = _attend(q[rows], k, v, s.start, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
