"""KV rows for batched ONNX Runtime graphs: one buffer per layer [rows, KVH, capacity, D] shared by all sequences.

A `RowPool` holds the KV of up to `rows` sequences, each in its own row of every buffer, and per graph
and row the positions held (`filled`). A batched forward runs a contiguous range of rows: the graphs take
the buffers' [first:first+B] slices (contiguous, bound as both past and present, written in place) and
`total_len` per row, so rows of different lengths share one call (one token per row: exporters.shared_kv).
Rows need not have the same length; they must be contiguous, which the runtime keeps by moving a row into
a hole (`move`). `row_cache(r)` is one row seen as a single-sequence cache (the ORTCache interface), so
every single-stream code path runs on a pool row unchanged. The pool does not know sequences or blocks:
runtime.batch.kv_rows keeps that accounting and runtime.batch.prefix_cache reads and writes positions through
`read` / `write`.
Invariant: a batched forward writes at filled[graph][row].. and advances nothing; the caller commits
(`commit`); a row cache advances its own row like ORTCache does.
"""

from __future__ import annotations

import numpy as np

from mirror_rt.devices.base import CacheBounds, lazy_zeros
from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.batch.splits import GROUP_COST, cheapest_groups

INITIAL_POSITIONS = 256  # a pool's room per row before its first request asks for more


class RowPool:
    """KV buffers of one model's graphs (a split target: prefix and suffix; a draft: one graph) for `rows` rows.

    Rows hold up to `capacity` positions; the buffers are allocated for `allocated` of them and `grow` as requests
    need more (a copy of what they hold): the pool's address space follows the longest request so far, never rows
    x the model's context. Memory is committed as positions are written (devices.base.lazy_zeros).
    """

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
        """Room for `positions` per row (at least twice the current room, at most `capacity`): new buffers hold what
        every row held. Not while another thread runs the pool (the decoder grows it at admission)."""
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
        [groups, 2] of (row end, keys), the cheapest cut (runtime.batch.splits.cheapest_groups), empty ones last."""
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
        """Positions start..n-1 of `source`'s row, every layer in order (a draft that is the target's copy starts
        from the target's prompt KV: its 30 layers are the prefix's 15 then the suffix's 15); `row` then holds n."""
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


def forward_rows(model, pool: RowPool, tokens: np.ndarray, first: int, last_rows: int | None = None) -> np.ndarray:
    """A one-graph model (draft) over rows first..: tokens [B, T] -> logits [B, T or last_rows, vocab]."""
    return pool.run(0, model.graph, np.asarray(tokens, dtype=np.int64), first, last_rows)["logits"]


def target_rows(target, pool: RowPool, tokens: np.ndarray, first: int, last_rows: int | None = None,
                wide: bool = False) -> np.ndarray:
    """A split target over rows first..: tokens [B, T] through its prefix then its suffix (no early exit) -> logits
    [B, T or last_rows, vocab]. `wide`: through the target's prompt sessions (a thread per core) where it has them."""
    prefix, suffix = target.prompt_graphs if wide and target.prompt_graphs else (target.prefix, target.suffix)
    hidden = pool.run(0, prefix, np.asarray(tokens, dtype=np.int64), first)["hidden"]
    return pool.run(1, suffix, hidden, first, last_rows)["logits"]


def split_rows(target, pool: RowPool, tokens: np.ndarray, cut: int, cpus: tuple[int, int], helper) -> np.ndarray:
    """Target-only rows 0..B-1 of `pool` as two calls at once (runtime.batch.splits): rows 0..cut-1 on cpus[0], the
    others on cpus[1] (`on_two_cores`), each through the target's one-thread sessions -> logits [B, T, vocab], the
    same bits as one call (a row computes alike in any call)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    head, tail = on_two_cores(lambda: target_rows(target, pool, tokens[:cut], 0),
                              lambda: target_rows(target, pool, tokens[cut:], cut), cpus, helper)
    return np.concatenate([head, tail])


def split_prompts(target, chunks: list, caches: list, cpus: tuple[int, int], helper) -> list[np.ndarray]:
    """Two prompts' chunks at once (runtime.batch.steps.Prefill): chunks[i] into caches[i] on cpus[i]
    (`on_two_cores`), each through the target's one-thread sessions -> each chunk's last logits [1, vocab] (the
    same bits as one prompt at a time)."""
    return list(on_two_cores(lambda: target.forward_last(chunks[0], caches[0]),
                             lambda: target.forward_last(chunks[1], caches[1]), cpus, helper))


def pinned_helper(helper: tuple | None, cpu: int) -> tuple:
    """(cpu, an executor of one thread pinned to `cpu`): `helper` where it is that already, else a new one."""
    if helper is None or helper[0] != cpu:
        from concurrent.futures import ThreadPoolExecutor

        helper = (cpu, ThreadPoolExecutor(1, thread_name_prefix="mirror-rows", initializer=pin, initargs=(cpu,)))
    return helper


def on_two_cores(first, second, cpus: tuple[int, int], helper) -> tuple:
    """(first(), second()) run at once: `first` in this thread pinned to cpus[0], `second` in `helper` (an executor
    whose thread is pinned to cpus[1]). `second` is waited for even when `first` fails: both write into the pool."""
    later = helper.submit(second)
    previous = pin(cpus[0])
    try:
        head = first()
    finally:
        restore(previous)
        tail = later.result()
    return head, tail
