"""KV rows for batched ONNX Runtime graphs: one buffer per layer [rows, KVH, capacity, D] shared by all sequences.

A batched forward runs a contiguous range of rows of any lengths (the graphs take the buffers' row slices, written in
place, and `total_len` per row); the runtime keeps rows contiguous (`move`) and does the accounting
(runtime.batch.kv_rows). A batched forward advances nothing (the caller `commit`s); `row_cache(r)` is one row as a
single-sequence cache that advances itself.
"""

from __future__ import annotations

import numpy as np

from mirror_rt.devices.base import CacheBounds, lazy_zeros
from mirror_rt.runtime.batch.splits import GROUP_COST, cheapest_groups

INITIAL_POSITIONS = 256  # a pool's room per row before its first request asks for more


class RowPool:
    """KV buffers of one model's graphs (a split target: prefix and suffix) for `rows` rows of up to `capacity`
    positions, allocated for `allocated` and grown as requests need more; committed as written (lazy_zeros)."""

    def __init__(self, graphs: list, rows: int, capacity: int):
        from mirror_rt.devices.onnxruntime.backend import _onnxruntime

        self.ort = _onnxruntime()
        self.rows, self.capacity, self.allocated = rows, capacity, min(capacity, INITIAL_POSITIONS)
        kvh, d = graphs[0].kv_shape
        self.buffers = [[lazy_zeros((rows, kvh, self.allocated, d), g.kv_dtype) for _ in g.past_names]
                        for g in graphs]
        self.filled = np.zeros((len(graphs), rows), dtype=np.int64)  # positions each graph holds per row
        self._values: dict = {}  # (graph, first, count) -> OrtValues over the rows' slices
        self._groups: tuple = (None, None)  # the last call's (key, attention groups): a split target's pair

    @property
    def lengths(self) -> np.ndarray:
        """Positions held per row (by the first graph; a split target's suffix lags only inside a call)."""
        return self.filled[0]

    def grow(self, positions: int) -> None:
        """Room for `positions` per row (at least twice the current room, at most `capacity`), in new buffers holding
        what every row held; never while another thread runs the pool."""
        if positions <= self.allocated:
            return
        size = min(self.capacity, max(positions, 2 * self.allocated))
        held = int(self.filled.max(initial=0))
        for graph in self.buffers:
            for i, old in enumerate(graph):
                new = lazy_zeros(old.shape[:2] + (size, old.shape[3]), old.dtype)
                new[:, :, :held] = old[:, :, :held]
                graph[i] = new
        self.allocated = size
        self._values.clear()  # OrtValues over the old buffers

    def commit(self, row: int, length: int) -> None:
        """Row `row` holds `length` positions in every graph (after a batched call, or a rollback)."""
        self.filled[:, row] = length

    def row_cache(self, row: int) -> RowCache:
        """Row `row` as a single-sequence cache (starts at the row's current length)."""
        return RowCache(self, row)

    @property
    def bytes_per_position(self) -> int:
        """KV bytes one position of one row takes over every buffer."""
        return sum(b.shape[1] * b.shape[3] * b.itemsize for graph in self.buffers for b in graph)

    def values(self, graph: int, first: int, count: int) -> list:
        """OrtValues over rows first..first+count-1 of every buffer of `graph` (made once, kept)."""
        key = (graph, first, count)
        if key not in self._values:
            self._values[key] = [self.ort.OrtValue.ortvalue_from_numpy(b[first:first + count])
                                 for b in self.buffers[graph]]
        return self._values[key]

    def run(self, graph_index: int, graph, x: np.ndarray, first: int, last_rows: int | None = None) -> dict:
        """Graph `graph_index` over rows first..first+B-1: x [B, T] ids or [B, T, hidden]; returns head outputs."""
        B, T = x.shape[0], x.shape[1]
        ends = self.filled[graph_index, first:first + B] + T
        if len(ends) != B or ends.max() > self.allocated:
            raise ValueError(f"rows {first}..{first + B - 1} cannot take {T} more positions "
                             f"(pool of {self.rows} rows, room for {self.allocated})")
        groups = self.attention_groups(ends, T, graph.groups) if graph.groups else None
        return graph.run_rows(x, self.values(graph_index, first, B), ends.astype(np.int32), last_rows, groups)

    def attention_groups(self, ends: np.ndarray, tokens: int, groups: int) -> np.ndarray:
        """Contiguous groups of rows whose attention reads their own longest row's keys (exporters.exact_kv):
        [groups, 2] of (row end, keys), the cheapest cut (runtime.batch.splits), empty ones last."""
        key, cached = (ends.tobytes(), tokens, groups), self._groups  # (one read: a pipelined prefill's threads)
        if cached[0] == key:
            return cached[1]
        cut = cheapest_groups(ends * tokens, groups, GROUP_COST)[1]
        rows = [[first + n, int(ends[first:first + n].max())] for first, n in cut]
        plan = np.array(rows + [[len(ends), 1]] * (groups - len(rows)), dtype=np.int64)
        self._groups = (key, plan)
        return plan

    def move(self, src: int, dst: int) -> None:
        """Copy row `src`'s committed positions into row `dst` (which then holds the same length)."""
        n = int(self.lengths[src])
        for graph in self.buffers:
            for b in graph:
                b[dst, :, :n] = b[src, :, :n]
        self.commit(dst, n)

    def read(self, row: int, start: int, stop: int) -> list[np.ndarray]:
        """Copies of positions start..stop-1 of `row`, one array [KVH, n, D] per buffer."""
        return [b[row, :, start:stop].copy() for graph in self.buffers for b in graph]

    def write(self, row: int, start: int, arrays: list[np.ndarray]) -> None:
        """Store `read`'s arrays at positions start.. of `row` (lengths unchanged)."""
        flat = [b for graph in self.buffers for b in graph]
        for b, a in zip(flat, arrays):
            b[row, :, start:start + a.shape[1]] = a

    def copy_from(self, row: int, source: RowPool, source_row: int, n: int, start: int = 0) -> None:
        """Positions start..n-1 of `source`'s row, every layer in order (a draft that copies the target adopts its
        prompt KV: its layers are the prefix's then the suffix's); `row` then holds n."""
        mine = [b for graph in self.buffers for b in graph]
        theirs = [b for graph in source.buffers for b in graph]
        if len(mine) != len(theirs) or mine[0].shape[1:] != theirs[0].shape[1:]:
            raise ValueError("cannot adopt KV of another shape (the draft is not a copy of the target)")
        for b, s in zip(mine, theirs):
            b[row, :, start:n] = s[source_row, :, start:n]
        self.commit(row, n)


class RowCache(CacheBounds):
    """One row of a `RowPool` with the interface of a single-sequence ORTCache (models' forward, rollback)."""

    def __init__(self, pool: RowPool, row: int):
        self.pool, self.row = pool, row
        self.capacity = pool.capacity
        self.shared = True
        self.hidden: np.ndarray | None = None  # split target: prefix rows the suffix has not seen

    @property
    def filled(self) -> list[int]:
        return [int(f) for f in self.pool.filled[:, self.row]]

    @property
    def length(self) -> int:
        return int(self.pool.filled[0, self.row])

    def run(self, index: int, graph, x: np.ndarray, last_rows: int | None = None) -> dict:
        """Graph `index` over this row: x [T] ids or [T, hidden] -> head outputs without the batch dimension."""
        head = self.pool.run(index, graph, x[None], self.row, last_rows)
        self.pool.filled[index, self.row] += len(x)
        return {name: out[0] for name, out in head.items()}

    def rollback(self, length: int) -> None:
        """Forget positions >= length in every graph of the row (a count). O(1)."""
        self.check_rollback(length)
        self.pool.filled[:, self.row] = np.minimum(self.pool.filled[:, self.row], length)
        self.keep_hidden(length, int(self.pool.filled[-1, self.row]))

