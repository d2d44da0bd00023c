"""Rotary position embeddings with the scaling types of HF checkpoints
(https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/modeling_rope_utils.py).

:class:`RopeConfig` reads ``rope_scaling`` / ``rope_parameters`` of a ``config.json`` as transformers 5.x does
(``rope_scaling`` wins when both are set; the legacy key ``type`` is ``rope_type``); :class:`Rotary` turns it into
cos / sin and rotates q and k. Types, each computed as transformers computes it:

- ``default``: ``inv_freq[i] = theta^(-2i/d)``;
- ``linear``: default / ``factor``;
- ``dynamic`` (NTK): theta grows with the sequence once it is longer than ``max_position_embeddings`` (each chunk of
  a sequence uses the frequencies of the sequence's length at the end of that chunk, as transformers' cached
  generation does);
- ``yarn``: the ramp between interpolated and original frequencies from ``beta_fast`` / ``beta_slow``, ``truncate``,
  and cos / sin scaled by the attention factor (``attention_factor``, else from ``mscale`` / ``mscale_all_dim``);
  DeepSeek-V3's extra softmax factor is :meth:`RopeConfig.mla_mscale` squared;
- ``llama3``: per-wavelength smoothing with ``low_freq_factor`` / ``high_freq_factor``.

Refused by name: ``longrope`` and ``proportional`` (and per-layer-type rope dicts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .forward_batch import ForwardBatch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One model's rotary embedding: type, base ``theta``, rotary ``dim`` per head (``head_dim`` x
    ``partial_rotary_factor``) and the type's parameters (HF names)."""

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 64
    max_position_embeddings: int = 4096
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @classmethod
    def from_hf(
        cls,
        cfg: dict[str, Any],
        head_dim: int,
        default_theta: float = 10000.0,
        default_partial_rotary_factor: float = 1.0,
    ) -> RopeConfig:
        """From a parsed ``config.json``; ``head_dim`` is the per-head size rotary dims are counted in (DeepSeek:
        ``qk_rope_head_dim``). Raises ValueError naming an unsupported ``rope_type`` or a missing parameter."""
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        layer_types = set(cfg.get("layer_types") or ())
        if layer_types and layer_types & set(params):
            raise ValueError(f"config.json: per-layer-type rope parameters {sorted(params)} are not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope_type={rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
        partial = float(
            params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial_rotary_factor))
        )
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        values: dict[str, Any] = dict(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", cfg.get("rope_theta", default_theta))),
            dim=int(head_dim * partial),
            max_position_embeddings=max_pos,
            original_max_position_embeddings=int(original or max_pos),
        )
        if rope_type == "default":
            return cls(**values)

        def need(key: str) -> Any:
            if params.get(key) is None:
                raise ValueError(f"config.json: rope_type={rope_type!r} needs rope parameter {key!r}")
            return params[key]

        if rope_type == "yarn":
            factor = params.get("factor")
            values.update(
                factor=float(factor) if factor is not None else max_pos / values["original_max_position_embeddings"],
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(params.get("mscale") or 0),
                mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                attention_factor=params.get("attention_factor"),
                truncate=bool(params.get("truncate", True)),
            )
        else:
            values["factor"] = float(need("factor"))
        if rope_type == "llama3":
            values.update(
                low_freq_factor=float(need("low_freq_factor")), high_freq_factor=float(need("high_freq_factor"))
            )
        return cls(**values)

    def base_inv_freq(self) -> torch.Tensor:
        """``theta^(-2i/d)``: `[dim // 2]` with `torch.float32`."""
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """The type's static frequencies `[dim // 2]` `torch.float32` and the cos / sin factor (``dynamic``: those
        of sequences up to ``max_position_embeddings``)."""
        inv = self.base_inv_freq()
        if self.rope_type == "linear":
            return inv / self.factor, 1.0
        if self.rope_type == "yarn":
            return self._yarn()
        if self.rope_type == "llama3":
            return self._llama3(inv), 1.0
        if self.rope_type == "dynamic":
            return self.dynamic_inv_freq(self.max_position_embeddings), 1.0
        return inv, 1.0

    def dynamic_inv_freq(self, seq_len: int | torch.Tensor) -> torch.Tensor:
        """NTK frequencies for a sequence of ``seq_len`` tokens: `[dim // 2]` with `torch.float32`. As transformers:
        Python floats for an int (its initial frequencies), float32 tensors for a tensor (while generating)."""
        m = self.max_position_embeddings
        length = torch.clamp(seq_len, min=m) if isinstance(seq_len, torch.Tensor) else max(seq_len, m)
        theta = self.theta * ((self.factor * length / m) - (self.factor - 1)) ** (self.dim / (self.dim - 2))
        return 1.0 / (theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))

    def _yarn(self) -> tuple[torch.Tensor, float]:
        d, s = self.dim, self.factor
        factor = self.attention_factor
        if factor is None:
            both = self.mscale and self.mscale_all_dim
            factor = _mscale(s, self.mscale) / _mscale(s, self.mscale_all_dim) if both else _mscale(s)

        def correction_dim(rotations: float) -> float:
            return (
                d
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        pos_freqs = self.theta ** (torch.arange(0, d, 2).float() / d)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s * pos_freqs)
        keep = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        return interpolation * (1 - keep) + extrapolation * keep, float(factor)

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def mla_mscale(self) -> float:
        """DeepSeek-V3's softmax scale is multiplied by this twice: ``mscale(factor, mscale_all_dim)`` for a scaled
        rope with a non-zero ``mscale_all_dim`` (1.3689 for DeepSeek-V3 / R1: x1.8739), else 1
        (https://github.com/deepseek-ai/DeepSeek-V3/blob/9b4e978/inference/model.py)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return _mscale(self.factor, self.mscale_all_dim)


def token_seq_lens(batch: ForwardBatch, rotary: Rotary) -> torch.Tensor | None:
    """Per token, its sequence's length at the end of its chunk (`[num_tokens]` `torch.int64`), for the ``dynamic``
    rope type; None for the other types (they do not read it)."""
    if rotary.rope.rope_type != "dynamic":
        return None
    lengths = batch.positions.new_zeros(batch.num_tokens + 1)  # + the scratch row padding queries point at
    for group in batch.groups:
        ends = group.query_pos.amax(dim=1, keepdim=True) + 1  # a chunk's last position (padding is 0) + 1
        lengths[group.rows] = ends.expand_as(group.rows)
    return lengths[:-1]


class Rotary(nn.Module):
    """Rotary embedding of the first ``rope.dim`` dims of each head (the rest pass through): ``rotate_half`` pairs
    (dims i and i + dim/2), or interleaved pairs (2i, 2i+1; DeepSeek), whose rotated dims come out evens then odds as
    in transformers."""

    def __init__(self, rope: RopeConfig, interleave: bool = False) -> None:
        super().__init__()
        self.rope, self.interleave = rope, interleave
        inv_freq, self.attention_factor = rope.inv_freq()
        # A non-persistent buffer (not in the state dict, which the loader fills): computed here, on the build device.
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 `[T]` -> cos, sin `[T, dim]` in ``dtype`` (angles duplicated, as HF). ``seq_lens``
        int64 `[T]`, the length of each token's sequence at the end of its chunk, is read by ``dynamic`` only."""
        inv = self.inv_freq[None, :]
        if self.rope.rope_type == "dynamic" and seq_lens is not None:
            lengths, per_token = torch.unique(seq_lens, return_inverse=True)
            inv = torch.stack([self._dynamic_freq(n) for n in lengths.cpu()])[per_token]
        freqs = positions.float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def step_cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` at ``batch``'s positions as `[num_tokens, 1, dim]`, computed once per step and rope config
        (the layers of a model share it)."""
        key = ("rope", id(self.rope), dtype)
        if key not in batch.memo:
            cos, sin = self.cos_sin(batch.positions, dtype, token_seq_lens(batch, self))
            batch.memo[key] = cos[:, None], sin[:, None]
        return batch.memo[key]

    def _dynamic_freq(self, seq_len: torch.Tensor) -> torch.Tensor:
        """A sequence's frequencies: the initial ones up to ``max_position_embeddings`` tokens, then NTK-scaled."""
        if int(seq_len) <= self.rope.max_position_embeddings:
            return self.inv_freq
        return self.rope.dynamic_inv_freq(seq_len).to(self.inv_freq.device)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``x`` `[T, heads, head_dim]`, cos/sin `[T, 1, dim]` (:meth:`step_cos_sin`) -> rotated ``x``, same shape and
        dtype."""
        dim = cos.shape[-1]
        rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
        if self.interleave:
            c, s = cos[..., : dim // 2], sin[..., : dim // 2]
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., : dim // 2], rot[..., dim // 2 :]
            out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)
