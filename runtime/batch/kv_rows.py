"""Rows and blocks of the batched KV cache: which sequence holds which row, and how much it may hold.

`RowMap` keeps the rows in use at 0..A-1; `BlockBudget` counts KV in blocks: a request that cannot fit waits, one
that can never fit is refused. Pure bookkeeping: it reads no tensor. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

BLOCK_SIZE = 16


def blocks_for(positions: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // block_size)


class RowMap:
    """Rows 0..A-1 held by sequences, in row order."""

    def __init__(self, rows: int):
        self.rows = rows
        self.order: list = []  # keys by row index

    def __len__(self) -> int:
        return len(self.order)

    def add(self, key) -> int | None:
        """The next row for `key`, or None when every row is held."""
        if len(self.order) >= self.rows:
            return None
        self.order.append(key)
        return len(self.order) - 1

    def remove(self, key) -> tuple[int, int] | None:
        """Free `key`'s row; the last row moves into it: returns (source, destination) or None (no move)."""
        row = self.order.index(key)
        last = len(self.order) - 1
        if row == last:
            self.order.pop()
            return None
        self.order[row] = self.order.pop()
        return last, row


class BlockBudget:
    """Blocks reserved per sequence out of `total`; the prefix cache uses what is left (`spare`)."""

    def __init__(self, total: int):
        self.total = total
        self.held: dict = {}  # key -> blocks reserved

    @property
    def reserved(self) -> int:
        return sum(self.held.values())

    @property
    def spare(self) -> int:
        """Blocks no sequence reserves (the prefix cache may hold them)."""
        return self.total - self.reserved

    def reserve(self, key, blocks: int, cached: int = 0) -> bool:
        """Reserve `blocks` for `key` if they fit beside the others (`cached`: blocks the prefix cache holds
        that it cannot give up now); False leaves nothing reserved."""
        if blocks > self.total - self.reserved - cached:
            return False
        self.held[key] = blocks
        return True

    def release(self, key) -> None:
        self.held.pop(key, None)

