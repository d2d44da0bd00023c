"""What a KV transfer moves: the layout of a worker's paged cache (:class:`KVLayout`, compared at the handshake)
and the byte ranges of a request's tokens in it (:func:`token_ranges`).

A worker's cache is, per layer, one tensor per cached quantity, each ``[num_blocks, block_size, *shape]``
(:class:`~server.models.kv_cache.PagedKVCache`): tokens ``[t0, t1)`` of one block are one contiguous byte range of
each tensor, so a request's first ``n`` tokens move as ``num_tensors * num_blocks_touched`` ranges of exactly
``n * bytes_per_token`` bytes in all (a partial last block moves only its filled tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


class LayoutMismatch(ValueError):
    """The two instances' KV caches differ (model, dtype, block size, layers or per-token shapes)."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """An instance's KV cache as the other side must see it. ``token_bytes``: per cache tensor (layer-major), the
    bytes one token takes in it; ``model``: the model's identity (its name and shape)."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    token_bytes: tuple[int, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(self.token_bytes)

    def describe(self) -> str:
        return (
            f"model {self.model}, dtype {self.dtype}, block-size {self.block_size}, {self.num_layers} layers, "
            f"{self.bytes_per_token} KV bytes per token"
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> KVLayout:
        return cls(
            str(data["model"]),
            str(data["dtype"]),
            int(data["block_size"]),
            int(data["num_layers"]),
            tuple(int(b) for b in data["token_bytes"]),
        )

    def check_matches(self, other: KVLayout, self_name: str, other_name: str) -> None:
        """Raise :class:`LayoutMismatch` naming both sides unless ``other`` has this exact layout."""
        if other != self:
            raise LayoutMismatch(
                f"KV cache layouts differ, refusing the transfer: {self_name} has "
                f"{self.describe()}; {other_name} has {other.describe()}"
            )


def token_ranges(
    bases: Sequence[int],
    block_bytes: Sequence[int],
    token_bytes: Sequence[int],
    blocks: Sequence[int],
    block_size: int,
    start: int,
    stop: int,
) -> list[tuple[int, int]]:
    """``(address, length)`` of tokens ``[start, stop)`` of a request whose block table is ``blocks``, in a cache
    whose tensor ``i`` starts at ``bases[i]`` with ``block_bytes[i]`` bytes per block and ``token_bytes[i]`` per
    token; in the same order on both sides (tensor-major, then block), so the i-th ranges of the two sides match."""
    ranges = []
    for base, per_block, per_token in zip(bases, block_bytes, token_bytes, strict=True):
        pos = start
        while pos < stop:
            index, offset = divmod(pos, block_size)
            n = min(block_size - offset, stop - pos)
            ranges.append((base + blocks[index] * per_block + offset * per_token, n * per_token))
            pos += n
    return ranges
