"""What one forward step runs: a flat batch of tokens from several sequences and where their keys/values live.

The KV cache is paged (:class:`~server.models.kv_cache.PagedKVCache`): a sequence's token at position ``p`` is
stored in block ``block_table[p // block_size]`` at offset ``p % block_size``. A step mixes decode tokens and
prefill chunks; attention runs batched over all sequences of an :class:`AttentionGroup` (the decodes of the step in
one group, its prefill chunks in another, so decodes are not padded to a chunk's length). Every index tensor is
built once per step, on the model's device, and shared by all layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class SeqInput:
    """One sequence's tokens in a step: ``token_ids`` at positions ``[start, start + len(token_ids))``, their keys
    and values written to (and read from) the cache blocks ``block_table`` (enough blocks for ``start +
    len(token_ids)`` tokens). ``sample`` asks for the logits of the last token, ``all_logits`` for those of every
    token of the chunk (in order; e.g. for prompt log-probabilities)."""

    block_table: Sequence[int]
    start: int
    token_ids: Sequence[int]
    sample: bool = True
    all_logits: bool = False


@dataclasses.dataclass
class AttentionGroup:
    """Sequences attended in one batched call, their queries padded to the longest chunk of the group.

    Arguments:
        rows: `[num_seqs, max_q]` with `torch.int64`, each query's row in the flat batch; padding queries point at
            row ``num_tokens``, a scratch row whose output is dropped.
        query_pos: `[num_seqs, max_q]` with `torch.int64`, each query's position in its sequence (padding: 0).
        block_table: `[num_seqs, max_blocks]` with `torch.int64`, padded with block 0 (masked out).
    """

    rows: torch.Tensor
    query_pos: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    padded: bool  # some sequence has fewer queries than the longest (rows point at the scratch row)
    _masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Which keys each query attends: causal, and with ``window`` only the last ``window`` positions (the
        query's own included); built once per step and window. Padding queries attend key 0 only (their output is
        dropped).

        Returns:
            mask: `[num_seqs, 1, max_q, max_blocks * block_size]` with `torch.bool` (True: attend).
        """
        if window not in self._masks:
            keys = torch.arange(self.block_table.shape[1] * self.block_size, device=self.rows.device)
            pos = self.query_pos[:, :, None]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            self._masks[window] = mask[:, None]
        return self._masks[window]


@dataclasses.dataclass
class ForwardBatch:
    """A flat batch for one step.

    Arguments:
        input_ids: `[num_tokens]` with `torch.int64`.
        positions: `[num_tokens]` with `torch.int64`, each token's position in its sequence.
        slot_mapping: `[num_tokens]` with `torch.int64`, each token's cache slot (``block * block_size + offset``).
        sample_rows: `[num_rows]` with `torch.int64`, rows whose logits the step returns.
        groups: the attention groups (decodes, prefill chunks), each sequence in exactly one.
        num_tokens_all_ranks: the step's tokens summed over every EP rank (bounds the rows an MoE layer receives),
            or None when unknown (the MoE layer then assumes every rank sends its full capacity).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample_rows: torch.Tensor
    groups: list[AttentionGroup]
    num_tokens_all_ranks: int | None = None
    memo: dict = dataclasses.field(default_factory=dict)  # what the layers compute once per step (rope's cos / sin)
    micro: tuple[ForwardBatch, ForwardBatch] | None = None  # the step as two micro-batches (two_batch.py), or None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        block_size: int,
        device: torch.device | str = "cpu",
        num_tokens_all_ranks: int | None = None,
    ) -> ForwardBatch:
        """The batch of ``seqs`` (in row order) for a cache of ``block_size``-token blocks, on ``device``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        # (sequence, its first row) of the decodes, and of the prefill chunks
        members: tuple[list[tuple[SeqInput, int]], ...] = ([], [])
        for seq in seqs:
            n, first = len(seq.token_ids), len(ids)
            if len(seq.block_table) * block_size < seq.start + n:
                raise ValueError(
                    f"block_table of {len(seq.block_table)} blocks of {block_size} cannot hold {seq.start + n} tokens"
                )
            ids.extend(seq.token_ids)
            for p in range(seq.start, seq.start + n):
                positions.append(p)
                slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
            if seq.all_logits:
                rows.extend(range(first, first + n))
            elif seq.sample:
                rows.append(first + n - 1)
            if n:
                members[n > 1].append((seq, first))
        groups = [_group(m, len(ids), block_size, device) for m in members if m]
        return cls(
            _long(ids, device),
            _long(positions, device),
            _long(slots, device),
            _long(rows, device),
            groups,
            num_tokens_all_ranks,
        )


def _group(
    members: list[tuple[SeqInput, int]], num_tokens: int, block_size: int, device: torch.device | str
) -> AttentionGroup:
    """The attention group of ``members`` (each a sequence and its first row in the flat batch)."""
    max_q = max(len(s.token_ids) for s, _ in members)
    max_blocks = max(-(-(s.start + len(s.token_ids)) // block_size) for s, _ in members)
    rows, query_pos, tables = [], [], []
    for seq, first in members:
        n, pad = len(seq.token_ids), max_q - len(seq.token_ids)
        rows.append(list(range(first, first + n)) + [num_tokens] * pad)
        query_pos.append(list(range(seq.start, seq.start + n)) + [0] * pad)
        used = -(-(seq.start + n) // block_size)
        tables.append(list(seq.block_table[:used]) + [0] * (max_blocks - used))
    padded = any(len(seq.token_ids) < max_q for seq, _ in members)
    return AttentionGroup(_long(rows, device), _long(query_pos, device), _long(tables, device), block_size, padded)


def _long(values: list, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
