"""Attention layers over the paged KV cache: GQA (every family but DeepSeek-V3; sinks and a sliding window for
gpt-oss) and MLA (DeepSeek-V3).

A forward step runs a flat batch of tokens from several sequences (decode tokens and prefill chunks mixed). The
projections run over the whole batch; each layer writes the step's keys/values into the cache blocks
(:func:`~server.models.paged_attention.write_kv`) and attends batched over every sequence
(:func:`~server.models.paged_attention.paged_attention`); a step of decodes alone does both in one kernel call per
layer where it applies (:func:`~deep_ep_npu.kernels.attention.decode_attention`).
"""

from __future__ import annotations

import torch
from torch import nn

from deep_ep_npu.kernels.attention import decode_attention

from .config import ModelConfig
from .forward_batch import ForwardBatch
from .layers import RMSNorm
from .linear import Linear
from .paged_attention import paged_attention, write_kv
from .qkv import QKVProjections
from .rope import Rotary


def attention_class(cfg: ModelConfig) -> type[GQAttention] | type[MLAttention]:
    """The attention layer of ``cfg``'s architecture."""
    return MLAttention if cfg.use_mla else GQAttention


class GQAttention(QKVProjections):
    """Grouped-query attention with HF's parameter names (``q_proj``/``k_proj``/``v_proj``/``o_proj``, optional
    ``q_norm``/``k_norm``, gpt-oss' ``sinks``: :class:`~server.models.qkv.QKVProjections`), a sliding ``window`` on
    sliding layers. Cache per layer: keys and values, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    @staticmethod
    def cache_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
        """Per token: keys, values."""
        return [(cfg.num_key_value_heads, cfg.head_dim), (cfg.num_key_value_heads, cfg.head_dim)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv, q, k, v = self.project(x, batch)
        k_cache, v_cache = cache
        sinks = getattr(self, "sinks", None)
        group = batch.groups[0] if len(batch.groups) == 1 else None
        if qkv is not None and group is not None and group.rows.shape[1] == 1:  # decodes alone: row i is sequence i
            out = decode_attention(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                k_cache,
                v_cache,
                batch.slot_mapping,
                group.block_table,
                batch.positions,
                self.head_dim**-0.5,
                self.window,
                sinks,
            )
            if out is not None:
                return self.o_proj(out)
        write_kv(k_cache, batch.slot_mapping, k)
        write_kv(v_cache, batch.slot_mapping, v)
        out = paged_attention(q, k_cache, v_cache, batch, self.head_dim**-0.5, self.window, sinks)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention with HF's parameter names. The cache holds, per token, the
    compressed latent (after ``kv_a_layernorm``) and the rotated shared key side by side: `[num_blocks, block_size,
    1, kv_lora_rank + qk_rope_head_dim]`. Attention runs in the latent space (``kv_b_proj`` absorbed): each head's
    query is mapped into it through the key half of ``kv_b_proj``, attends the cached latents as one shared
    key/value head, and the result leaves it through the value half; the same scores as expanding every cached
    latent into per-head keys and values, without doing so."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=cfg.o_bias)
        self.rotary = Rotary(cfg.rope, interleave=cfg.rope_interleave)
        mscale = cfg.rope.mla_mscale()  # YaRN: the softmax scale gains mscale^2 (as transformers)
        self.scale = qk**-0.5 * mscale * mscale

    @staticmethod
    def cache_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
        """Per token: the latent and the rotated shared key, concatenated."""
        return [(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = self.rotary.step_cos_sin(batch, x.dtype)
        q_rot = self.rotary.apply(q_rot, cos, sin)
        k_rot = self.rotary.apply(k_rot[:, None, :], cos, sin)[:, 0]
        (kv_cache,) = cache
        write_kv(kv_cache, batch.slot_mapping, torch.cat((latent, k_rot), dim=-1)[:, None])
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_k, w_v = w_kv[:, : self.nope], w_kv[:, self.nope :]  # [heads, nope, rank], [heads, v_dim, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [t, heads, rank]
        q = torch.cat((q_latent, q_rot), dim=-1)
        out = paged_attention(q, kv_cache, kv_cache[..., : self.kv_lora_rank], batch, self.scale)
        out = torch.bmm(out.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)  # [t, heads, v_dim]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
