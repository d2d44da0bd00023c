"""The KV-cache blocks of one worker, as the driver sees them (pure Python): who holds which block, and the prefix
cache.

A request holds a list of blocks (its block table); its token at position ``p`` lives in block ``p // block_size``
of that list. Blocks are reference-counted: prefix caching lets requests that start with the same tokens share the
blocks of that prefix. A *full* block (``block_size`` computed tokens) is registered under a key chained to its
parent: ``(key id of the previous block of the sequence, its token ids)`` - exact, so two different prefixes never
share a key. A block nobody holds stays in the cache, in the free queue, until it is reused for something else:
the least recently freed first (LRU); a request frees its blocks last-first, so a prefix's tail is evicted before
its head.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

ROOT = 0  # the key id a sequence's first block chains to


class BlockPool:
    """``num_blocks`` blocks: reference counts, the free queue (LRU order) and the prefix-cache index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.key_of: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.key_id_of = [ROOT] * num_blocks
        self.cached: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._next_key_id = ROOT + 1

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (cached ones included: they are evicted when taken)."""
        return len(self.free)

    def take(self, n: int) -> list[int]:
        """``n`` blocks from the free queue's head (evicting cached ones), each held once. Check :attr:`num_free`."""
        assert n <= len(self.free), "take() needs that many free blocks"
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.key_of[block]
            if key is not None:
                del self.cached[key]
                self.key_of[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def hold(self, block: int) -> None:
        """Hold a cached block once more (a prefix hit)."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each of ``blocks``, last first; unheld blocks join the free queue's tail."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None

    def lookup(self, parent_id: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding ``token_ids`` after the prefix whose last block has key id ``parent_id``."""
        return self.cached.get((parent_id, token_ids))

    def register(self, block: int, parent_id: int, token_ids: tuple[int, ...]) -> int:
        """Cache full ``block`` (``token_ids`` after the prefix ending in key id ``parent_id``); returns the key id
        its successor chains to (the existing entry's when an equal block is cached already)."""
        key = (parent_id, token_ids)
        existing = self.cached.get(key)
        if existing is not None:
            return self.key_id_of[existing]
        self.cached[key] = block
        self.key_of[block] = key
        self.key_id_of[block] = self._next_key_id
        self._next_key_id += 1
        return self.key_id_of[block]


class BlockTable:
    """One request's blocks: ``blocks`` (its block table), ``key_ids`` (the key id of each leading block that is
    cached, in order) and ``num_sent`` (how many of ``blocks`` its worker has been told about)."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.key_ids: list[int] = []
        self.num_sent = 0

    def take_new(self) -> tuple[list[int], bool]:
        """The blocks the worker has not been told about, and whether they replace its table (a fresh start)."""
        new, reset = self.blocks[self.num_sent :], self.num_sent == 0
        self.num_sent = len(self.blocks)
        return new, reset


class KVCacheManager:
    """The blocks of one worker's requests: allocation step by step, prefix-cache hits (``enable_prefix_caching``)
    and release. Counts the prefix-cache queries and hits in tokens (vLLM's metric)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queries = 0
        self.num_hits = 0

    @property
    def usage(self) -> float:
        """The fraction of blocks held by requests (cached blocks nobody holds count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The cached blocks of the longest full-block prefix of ``token_ids`` and their key ids; the last token is
        never matched (its logits are needed)."""
        blocks: list[int] = []
        key_ids: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, key_ids
        bs, parent = self.block_size, ROOT
        for i in range((len(token_ids) - 1) // bs):
            block = self.pool.lookup(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            parent = self.pool.key_id_of[block]
            blocks.append(block)
            key_ids.append(parent)
        return blocks, key_ids

    def admit(self, table: BlockTable, token_ids: Sequence[int], max_new_tokens: int) -> int | None:
        """Give a request starting over (an empty ``table``) the cached prefix of ``token_ids`` and blocks for up
        to ``max_new_tokens`` of the rest; returns how many tokens were found cached, or None (nothing changed)
        when the blocks are not there."""
        hits, key_ids = self.match_prefix(token_ids)
        num_cached = len(hits) * self.block_size
        num_tokens = num_cached + min(len(token_ids) - num_cached, max_new_tokens)
        need = self.num_blocks_for(num_tokens) - len(hits)
        if need > self.pool.num_free - sum(1 for b in hits if self.pool.ref_count[b] == 0):
            return None
        for block in hits:
            self.pool.hold(block)
        table.blocks, table.key_ids = hits + self.pool.take(need), key_ids
        self.num_queries += len(token_ids)
        self.num_hits += num_cached
        return num_cached

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Make ``table`` hold ``num_tokens`` tokens; False (nothing changed) when the blocks are not there."""
        need = self.num_blocks_for(num_tokens) - len(table.blocks)
        if need > self.pool.num_free:
            return False
        if need > 0:
            table.blocks += self.pool.take(need)
        return True

    def cache_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register each block of ``table`` now full: of the first ``num_computed`` positions, those whose token
        ids (``token_ids``, prompt then output) are known."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.key_ids), min(min(num_computed, len(token_ids)) // bs, len(table.blocks))):
            parent = table.key_ids[-1] if table.key_ids else ROOT
            table.key_ids.append(self.pool.register(table.blocks[i], parent, tuple(token_ids[i * bs : (i + 1) * bs])))

    def forget(self, table: BlockTable) -> None:
        """Take ``table``'s blocks out of the prefix cache (their contents never arrived, e.g. a failed KV pull)."""
        for block in table.blocks:
            key = self.pool.key_of[block]
            if key is not None and self.pool.cached.get(key) == block:
                del self.pool.cached[key]
            self.pool.key_of[block] = None
        table.key_ids = []

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table`` (cached ones stay cached until evicted) and empty it."""
        self.pool.release(table.blocks)
        table.blocks, table.key_ids, table.num_sent = [], [], 0
