"""``MoECausalLM``: the decoder stack shared by every family (``architectures.py``), with HF's parameter names.

What differs per architecture lives in :class:`ModelConfig` and the pieces it selects: attention (GQA with its
biases, q/k norms and rotary, or MLA), the router semantics, which layers are MoE and the MoE block's name
(``mlp`` or Mixtral's ``block_sparse_moe``), shared experts (gated for Qwen2-MoE), and the on-disk names of expert
weights.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from . import two_batch
from .attention import GQAttention, MLAttention
from .config import ModelConfig
from .ep_comm import ExpertComm
from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache
from .layers import DenseMLP, RMSNorm
from .linear import Linear
from .moe import SparseMoE
from .qkv import QKVProjections


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, comm: ExpertComm) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg) if cfg.use_mla else GQAttention(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_fp32)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_fp32)
        self.is_moe = layer_idx in cfg.moe_layers
        self.mlp_name = cfg.moe_block if self.is_moe else "mlp"
        moe_index = list(cfg.moe_layers).index(layer_idx) if self.is_moe else 0  # (the placement's layer)
        mlp = SparseMoE(cfg, comm, moe_index) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        setattr(self, self.mlp_name, mlp)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, batch: ForwardBatch, cache: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``x`` plus the previous layer's output ``delta`` (None: nothing to add) -> this
        layer's residual stream and output (each residual add fused with the norm after it: :meth:`RMSNorm.add`)."""
        x, h = self.input_layernorm.add(x, delta)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, batch, cache))
        mlp = getattr(self, self.mlp_name)
        return x, mlp(h, batch.num_tokens_all_ranks) if self.is_moe else mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: ExpertComm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, comm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_fp32)


class MoECausalLM(nn.Module):
    """The model on one EP rank: every non-expert weight, plus this rank's routed experts (``comm`` decides which).

    Build and fill it with :mod:`server.loader` (checkpoint or random weights).
    """

    def __init__(self, cfg: ModelConfig, comm: ExpertComm) -> None:
        super().__init__()
        self.cfg, self.comm = cfg, comm
        self.model = Backbone(cfg, comm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run one step and write the new tokens' keys/values into ``cache``.

        Returns:
            logits: `[len(batch.sample_rows), vocab_size]` with `torch.float32`.
        """
        if batch.micro is not None:
            return self._forward_micro(batch.micro, cache)
        x, delta = self.model.embed_tokens(batch.input_ids), None
        for layer, layer_cache in zip(self.model.layers, cache.layers, strict=True):
            x, delta = layer(x, delta, batch, layer_cache)
        rows = batch.sample_rows
        _, x = self.model.norm.add(x[rows], None if delta is None else delta[rows])
        return self.lm_head(x).float()

    def _forward_micro(self, batches: tuple[ForwardBatch, ForwardBatch], cache: PagedKVCache) -> torch.Tensor:
        """:meth:`forward` of a step whose micro-batches are ``batches`` (:mod:`.two_batch`; logits rows: the first's
        sampled rows, then the second's, i.e. the whole step's in order)."""
        backbone, total = self.model, batches[0].num_tokens_all_ranks
        assert total is not None
        xs = [backbone.embed_tokens(b.input_ids) for b in batches]
        deltas: list[torch.Tensor | None] = [None, None]
        pending: list[two_batch.Receive | None] = [None, None]
        for module, layer_cache in zip(backbone.layers, cache.layers, strict=True):
            layer, routed = cast(DecoderLayer, module), list[two_batch.Routed]()
            for m, batch in enumerate(batches):
                receive, pending[m] = pending[m], None
                if receive is not None:
                    deltas[m] = receive()
                xs[m], h = layer.input_layernorm.add(xs[m], deltas[m])
                xs[m], h = layer.post_attention_layernorm.add(xs[m], layer.self_attn(h, batch, layer_cache))
                mlp = getattr(layer, layer.mlp_name)
                if layer.is_moe:
                    routed.append(two_batch.Routed(mlp, h, total))
                else:
                    deltas[m] = mlp(h)
            if routed:
                pending = list(two_batch.experts(getattr(layer, layer.mlp_name), routed, total))
        last = []
        for m, batch in enumerate(batches):
            receive = pending[m]
            delta = receive() if receive is not None else deltas[m]
            rows = batch.sample_rows
            last.append(backbone.norm.add(xs[m][rows], None if delta is None else delta[rows])[1])
        return self.lm_head(torch.cat(last)).float()

    def fuse_weights(self) -> None:
        """Fuse the projections that share an input (q / k / v, gate / up); the loader calls it once, after filling
        the weights."""
        for m in self.modules():
            if isinstance(m, (QKVProjections, DenseMLP)):
                m.fuse_weights()

    def moe_layers(self) -> list[SparseMoE]:
        return [getattr(layer, str(layer.mlp_name)) for layer in self.model.layers if layer.is_moe]

    def expert_checkpoint_keys(self, layer_idx: int, expert: int) -> tuple[str, str, str]:
        """The checkpoint names of global expert ``expert``'s (gate, up, down) weights in layer ``layer_idx``."""
        prefix = f"model.layers.{layer_idx}.{self.cfg.moe_block}.experts.{expert}"
        gate, up, down = (f"{prefix}.{name}.weight" for name in self.cfg.expert_keys)
        return gate, up, down
