"""KV rows for a torch Transformer: one key and one value tensor [layers, rows, KVH, capacity, D] for all sequences,
with the verbs of devices.onnxruntime.pool.RowPool. Batched forwards (TorchModel.forward_rows) run one row a call:
torch rounds a row differently beside another number of rows, and a row must compute what it computes alone.
"""

from __future__ import annotations

import numpy as np
import torch

from mirror_rt.devices.base import lazy_zeros
from mirror_rt.devices.torch.kv_cache import KVCache

NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
INITIAL_POSITIONS = 256  # a pool's room per row before its first request asks for more


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros committed as written on the CPU (devices.base.lazy_zeros), torch.zeros elsewhere."""
    if torch.device(device).type == "cpu" and dtype in NUMPY_DTYPES:
        return torch.from_numpy(lazy_zeros(shape, NUMPY_DTYPES[dtype]))
    return torch.zeros(shape, dtype=dtype, device=device)


class TorchPool:
    """Keys and values of `n_layers` layers for `rows` sequences of `capacity` positions."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, rows: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.rows, self.capacity, self.allocated = rows, capacity, min(capacity, INITIAL_POSITIONS)
        self.keys, self.values = (_zeros((n_layers, rows, n_kv_heads, self.allocated, head_dim), dtype, device)
                                  for _ in range(2))
        self.filled = np.zeros((1, rows), dtype=np.int64)  # positions held per row

    @property
    def lengths(self) -> np.ndarray:
        return self.filled[0]

    def grow(self, positions: int) -> None:
        """Room for `positions` per row, as devices.onnxruntime.pool.RowPool.grow."""
        if positions <= self.allocated:
            return
        size = min(self.capacity, max(positions, 2 * self.allocated))
        held = int(self.filled.max(initial=0))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = _zeros(old.shape[:3] + (size, old.shape[4]), old.dtype, old.device)
            new[:, :, :, :held] = old[:, :, :, :held]
            setattr(self, name, new)
        self.allocated = size

    @property
    def bytes_per_position(self) -> int:
        n, _, kvh, _, d = self.keys.shape
        return 2 * n * kvh * d * self.keys.element_size()

    def commit(self, row: int, length: int) -> None:
        self.filled[:, row] = length

    def row_cache(self, row: int) -> TorchRowCache:
        return TorchRowCache(self, row)

    def move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        for t in (self.keys, self.values):
            t[:, dst, :, :n] = t[:, src, :, :n]
        self.commit(dst, n)

    def read(self, row: int, start: int, stop: int) -> list[torch.Tensor]:
        return [t[:, row, :, start:stop].clone() for t in (self.keys, self.values)]

    def write(self, row: int, start: int, arrays: list[torch.Tensor]) -> None:
        for t, a in zip((self.keys, self.values), arrays):
            t[:, row, :, start:start + a.shape[2]] = a

    def copy_from(self, row: int, source: TorchPool, source_row: int, n: int, start: int = 0) -> None:
        """Positions start..n-1 of `source`'s row into `row`, which then holds n."""
        if self.keys.shape[0] != source.keys.shape[0] or self.keys.shape[2:] != source.keys.shape[2:]:
            raise ValueError("cannot adopt KV of another shape (the draft is not a copy of the target)")
        for t, s in ((self.keys, source.keys), (self.values, source.values)):
            t[:, row, :, start:n] = s[:, source_row, :, start:n].to(t)
        self.commit(row, n)


class TorchRowCache(KVCache):
    """One row of a `TorchPool` as a single-sequence KVCache (its length lives in the pool)."""

    def __init__(self, pool: TorchPool, row: int):  # noqa: D107 -- a view, no storage of its own
        self.pool, self.row = pool, row  # `row` follows the sequence when its row moves
        self.capacity, self.hidden = pool.capacity, None

    @property
    def keys(self) -> torch.Tensor:
        """[layers, KVH, capacity, D], a view of the pool at the current row."""
        return self.pool.keys[:, self.row]

    @property
    def values(self) -> torch.Tensor:
        return self.pool.values[:, self.row]

    @property
    def length(self) -> int:
        return int(self.pool.filled[0, self.row])

    @length.setter
    def length(self, value: int) -> None:
        self.pool.filled[0, self.row] = value

