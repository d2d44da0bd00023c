"""Which checkpoint tensor fills each value of a rank's model: the read plan shared by loading and start-up checks.

Every parameter and buffer reads the checkpoint tensor of its own name, except: a tied ``lm_head`` reads the
embedding (as transformers ties it); routed experts, stacked per rank as ``w13`` `[L, 2I, hidden]` (gate rows, then
up) and ``w2`` `[L, hidden, I]` (+ ``b13`` / ``b2`` with expert biases), read each local expert's
``experts.<e>.{gate,up,down}`` tensors, or, for families that store them fused (gpt-oss), the local experts' rows of
``experts.gate_up_proj`` `[E, hidden, 2I]` (gate and up columns interleaved) and ``experts.down_proj`` `[E, I,
hidden]` (+ ``_bias``), rearranged into that layout.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import torch

from ..models.model import MoECausalLM

_EXPERT_PARAM = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(w13|w2|b13|b2)$")


@dataclasses.dataclass(frozen=True)
class Read:
    """Checkpoint tensor ``name``, a float tensor of ``shape``; only ``rows`` of its first dim when given (fused
    expert tensors), then ``layout`` (a rearrangement into the destination's layout) when given."""

    name: str
    shape: tuple[int, ...]
    rows: range | None = None
    layout: Callable[[torch.Tensor], torch.Tensor] | None = None


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """`[..., 2I]` with gate / up interleaved (gate even) -> `[..., 2I]` gate half first."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def _fused_read(model: MoECausalLM, layer: int, which: str) -> Read:
    cfg, comm = model.cfg, model.comm
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    prefix = f"model.layers.{layer}.{cfg.moe_block}.experts."
    rows = comm.local_expert_ids
    if which == "w13":
        return Read(prefix + "gate_up_proj", (e, h, 2 * inter), rows, lambda t: _deinterleave(t).transpose(1, 2))
    if which == "b13":
        return Read(prefix + "gate_up_proj_bias", (e, 2 * inter), rows, _deinterleave)
    if which == "w2":
        return Read(prefix + "down_proj", (e, inter, h), rows, lambda t: t.transpose(1, 2))
    return Read(prefix + "down_proj_bias", (e, h), rows)


def checkpoint_reads(model: MoECausalLM) -> Iterator[tuple[torch.Tensor, Read]]:
    """``(destination, read)`` for every value ``model`` is filled with; the destination is a parameter or buffer
    or a slice of one, with the shape the read gives."""
    cfg = model.cfg
    for name, t in model.state_dict(keep_vars=True).items():
        match = _EXPERT_PARAM.match(name)
        if match is None:
            tied = name == "lm_head.weight" and cfg.tie_word_embeddings
            yield t.data, Read("model.embed_tokens.weight" if tied else name, tuple(t.shape))
            continue
        layer, which = int(match.group(1)), match.group(2)
        if cfg.fused_experts:
            yield t.data, _fused_read(model, layer, which)
            continue
        inter = cfg.moe_intermediate_size
        for j, e in enumerate(model.comm.local_experts(model.cfg.moe_layers.index(layer))):
            gate, up, down = model.expert_checkpoint_keys(layer, e)
            if which == "w13":
                yield t.data[j, :inter], Read(gate, (inter, cfg.hidden_size))
                yield t.data[j, inter:], Read(up, (inter, cfg.hidden_size))
            else:
                yield t.data[j], Read(down, (cfg.hidden_size, inter))
