"""Model tests drive the paged KV cache like fixed per-sequence slots: slot ``s`` of ``num_slots`` owns blocks ``s,
s + num_slots, s + 2 * num_slots, ...``, so the blocks of different sequences interleave in the cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server.models import ForwardBatch, MoECausalLM, PagedKVCache, SeqInput


class SlotCache:
    """A :class:`PagedKVCache` of ``num_slots`` sequences of up to ``max_len`` tokens, in blocks of ``block_size``."""

    def __init__(
        self, model: MoECausalLM, num_slots: int, max_len: int, dtype: torch.dtype = torch.float32, block_size: int = 4
    ) -> None:
        self.blocks_per_slot = -(-max_len // block_size)
        self.num_slots = num_slots
        self.cache = PagedKVCache(model.cfg, num_slots * self.blocks_per_slot, block_size, dtype)

    def table(self, slot: int) -> list[int]:
        return [slot + k * self.num_slots for k in range(self.blocks_per_slot)]

    def batch(self, chunks: Sequence[tuple[int, int, list[int]]], sample: Sequence[bool]) -> ForwardBatch:
        """The step of ``(slot, start, token_ids)`` chunks; ``sample[i]`` asks for chunk i's last logits."""
        seqs = [
            SeqInput(self.table(slot), start, tokens, want)
            for (slot, start, tokens), want in zip(chunks, sample, strict=True)
        ]
        return ForwardBatch.build(seqs, self.cache.block_size)

    def run(
        self, model: MoECausalLM, chunks: Sequence[tuple[int, int, list[int]]], sample: Sequence[bool]
    ) -> torch.Tensor:
        """One forward step of ``chunks``; the logits of the sampled rows."""
        return model(self.batch(chunks, sample), self.cache)
