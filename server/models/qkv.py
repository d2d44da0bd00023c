"""The q / k / v projections of grouped-query attention, per family, with HF's parameter names. Everything before the
attention itself: the projections (biases per family), the q / k norms (Qwen3 and GLM: RMSNorm over ``head_dim`` on each
head; OLMoE: over the whole q and k projections, before the split into heads), OLMoE's ``clip_qkv`` and the rotary
embedding (partial for GLM). The three projections run as one (their weights fused at load time, and again after a
dtype or device change); the per-head norms and rope of q and k as one kernel call, in place in the projection's
output.
:class:`~server.models.attention.GQAttention` subclasses :class:`QKVProjections` and attends with what
:meth:`QKVProjections.project` returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deep_ep_npu.kernels.rope import qk_norm_rope

from .config import ModelConfig
from .layers import RMSNorm
from .linear import FusedLinears, Linear, fuse_linears, linear
from .rope import Rotary

if TYPE_CHECKING:
    from .forward_batch import ForwardBatch


class QKVProjections(FusedLinears):
    """``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (+ ``q_norm`` / ``k_norm``) and the rotary embedding of layer
    ``layer_idx``; also what its attention reads: ``window`` (sliding layers: the last ``sliding_window`` positions,
    else None) and gpt-oss' ``sinks`` `[heads]` (a learned logit per head)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.window = (cfg.sliding_window or None) if cfg.is_sliding(layer_idx) else None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads))
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.o_bias)
        self.qk_norm, self.clip_qkv = cfg.qk_norm, cfg.clip_qkv
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.num_heads * d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * d, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_weights()

    def fuse_weights(self) -> None:
        """Lay ``q_proj`` / ``k_proj`` / ``v_proj`` out as one projection (:func:`~server.models.linear.fuse_linears`);
        the loader calls it once, after filling the weights (a forward step before that does it itself)."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def is_fused(self) -> bool:
        return self._qkv is not None

    def project(
        self, x: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` `[num_tokens, hidden]` -> (qkv, q, k, v): q `[num_tokens, heads, head_dim]`, k and v `[num_tokens,
        kv_heads, head_dim]`, dtype of ``x``, q and k rotated at ``batch.positions``; qkv is the fused projection's
        output `[num_tokens, (heads + 2 kv_heads) head_dim]` that q, k and v are views of, or None where they are not
        (then they are tensors of their own). One matmul for the three projections; the q / k norms (per head) and
        rope as one kernel call where it applies (:func:`~deep_ep_npu.kernels.rope.qk_norm_rope`)."""
        if self._qkv is None:
            self.fuse_weights()
        assert self._qkv is not None
        t, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, *self._qkv)
        cos, sin = self.rotary.step_cos_sin(batch, x.dtype)
        if self.qk_norm != "full" and self.clip_qkv is None:
            head = self.qk_norm == "head"
            q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if head else (None, None)
            if qk_norm_rope(qkv, h, kv, d, cos[:, 0], sin[:, 0], q_w, k_w, self.q_norm.eps if head else 0.0):
                q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
                return qkv, q.view(t, h, d), k.view(t, kv, d), v.view(t, kv, d)
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q, k, v = q.reshape(t, h, d), k.reshape(t, kv, d), v.reshape(t, kv, d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return None, self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v
