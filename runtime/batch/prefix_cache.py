"""Prefix cache: full blocks of verified KV kept after their request, reused by later requests that share them.

A block's key hashes its tokens and its parent's key, so a key names a whole prefix; `lookup` never counts the
prompt's last position. Eviction is LRU over whole blocks, deepest first (a kept block's ancestors are kept).
Only the target's KV is kept. Counters use vLLM's names and units (tokens): prefix_cache_queries,
prefix_cache_hits; `max_blocks` caps it.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict

import numpy as np

from mirror_rt.runtime.batch.kv_rows import BLOCK_SIZE


def block_keys(tokens: list[int], salt: bytes = b"", block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The key of each full block of `tokens`: hash(parent key, the block's ids)."""
    keys, parent = [], salt
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + ids[start:start + block_size].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Up to `max_blocks` blocks of KV (the pool's `read` arrays) by key, least recently used first; each holds
    `block_bytes` bytes (the target's KV of `block_size` positions)."""

    def __init__(self, max_blocks: int, salt: bytes = b"", block_size: int = BLOCK_SIZE, block_bytes: int = 0):
        self.max_blocks, self.salt, self.block_size, self.block_bytes = max_blocks, salt, block_size, block_bytes
        self.blocks: OrderedDict[bytes, list] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def bytes(self) -> int:
        """KV bytes the cached blocks hold."""
        return len(self.blocks) * self.block_bytes

    def lookup(self, tokens: list[int]) -> list[bytes]:
        """Keys of the cached blocks that start `tokens` (leaving its last position to compute); counted."""
        found = self.held(tokens)
        self.queries += len(tokens)
        self.hits += len(found) * self.block_size
        return found

    def held(self, tokens: list[int]) -> list[bytes]:
        """The keys `lookup` would find for `tokens`, without counting a query (admission asks before it evicts)."""
        keys = block_keys(tokens[:-1], self.salt, self.block_size)
        return keys[:next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))]

    def load(self, pool, row: int, keys: list[bytes]) -> int:
        """Copy the blocks `keys` into `row` from position 0; they become the most recently used. Returns
        the positions written."""
        for i, key in enumerate(keys):
            pool.write(row, i * self.block_size, self.blocks[key])
        self._touch(keys)
        return len(keys) * self.block_size

    def store(self, pool, row: int, tokens: list[int], limit: int | None = None) -> int:
        """Keep the full blocks of `tokens` (the row's committed positions) not kept yet; returns blocks added.

        `limit`: blocks the cache may hold now (the budget's spare); the least recently used make room.
        """
        keys = block_keys(tokens, self.salt, self.block_size)
        new = [(i, key) for i, key in enumerate(keys) if key not in self.blocks]
        room = self.max_blocks if limit is None else min(self.max_blocks, limit)
        self.evict(len(self.blocks) + len(new) - room)
        added = 0
        for i, key in reversed(new):  # leaf first: the root ends up the most recent
            if len(self.blocks) >= room:
                continue
            start = i * self.block_size
            self.blocks[key] = pool.read(row, start, start + self.block_size)
            added += 1
        self._touch(keys)
        return added

    def evict(self, count: int, keep: list[bytes] = ()) -> int:
        """Drop the `count` least recently used blocks, none of `keep`; returns how many were dropped."""
        kept = set(keep)
        victims = list(itertools.islice((key for key in self.blocks if key not in kept), max(count, 0)))
        for key in victims:
            del self.blocks[key]
        return len(victims)

    def _touch(self, keys: list[bytes]) -> None:
        """Make `keys` the most recently used, leaf first (a parent stays younger than its children)."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)
