"""What the backends share: cache checks (`CacheBounds`), the verbs of a one-graph model (`GraphModel`) and of a
split target (`SplitTarget`) over caches that run their graphs (`cache.run(index, graph, x, last_rows)`: ONNX Runtime,
OpenVINO), and `lazy_zeros` for KV pools. The boundary itself (`LoadedModel`, `Capabilities`) is runtime.backend.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from mirror_rt.runtime.backend import CacheFull, Capabilities

STREAM_LOGITS = "stream_logits"  # second output of SS draft graphs (exporters.ss_graph.STREAM_LOGITS)


class CacheBounds:
    """Checks shared by backend caches (subclasses provide `length` and `capacity`)."""

    def check_room(self, num_tokens: int) -> None:
        """CacheFull when `num_tokens` more positions would pass the capacity."""
        if self.length + num_tokens > self.capacity:
            raise CacheFull(f"KV cache full: {self.length + num_tokens} positions needed, "
                            f"capacity {self.capacity}")

    def check_rollback(self, length: int) -> None:
        """Raise ValueError unless 0 <= length <= self.length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} positions")

    def keep_hidden(self, length: int, suffix_filled: int) -> None:
        """After a rollback to `length`: keep the pending prefix rows the suffix (at `suffix_filled`) has not seen."""
        if self.hidden is not None:
            keep = length - suffix_filled
            self.hidden = self.hidden[:keep] if keep > 0 else None


class GraphCache(CacheBounds):
    """The KV of one or more graphs of the same model (a split target: prefix and suffix), `filled[i]` positions in
    graph i; a backend's cache adds its storage and `run(index, graph, x, last_rows)`."""

    def __init__(self, graphs: int, capacity: int):
        self.filled = [0] * graphs  # positions held by each graph
        self.capacity = capacity
        self.hidden: np.ndarray | None = None  # split target: prefix rows the suffix has not seen

    @property
    def length(self) -> int:
        """Positions committed (by the first graph; the suffix may lag by `hidden` rows)."""
        return self.filled[0]


class GraphModel:
    """A `LoadedModel` over one graph (the draft, or an unsplit target). An SS draft graph (a second output of
    stream logits, exporters.ss_graph) also has `forward_streams`: the lookahead streams' logits, which Mirror's
    draft rows use to confirm several tokens per forward."""

    def __init__(self, graph, vocab_size: int, max_seq_len: int, n_streams: int | None = None, rows: bool = False):
        self.graph, self.vocab_size, self.max_seq_len, self.n_streams = graph, vocab_size, max_seq_len, n_streams
        self.capabilities = Capabilities(rows=rows, streams=STREAM_LOGITS in graph.output_names)

    def forward(self, tokens: Sequence[int], cache, last_rows: int | None = None) -> np.ndarray:
        """tokens [T] at positions cache.length.. -> logits [T, vocab] (or its last `last_rows`); advances by T."""
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        logits = cache.run(0, self.graph, ids, last_rows)["logits"]
        return logits[-last_rows:] if last_rows else logits

    def forward_last(self, tokens: Sequence[int], cache) -> np.ndarray:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        return self.forward(tokens, cache, last_rows=1)

    def forward_streams(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """tokens [T] -> main logits [T, vocab], stream logits [T, n_s, vocab]; advances the cache by T."""
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        head = cache.run(0, self.graph, ids, len(ids))
        return head["logits"], head[STREAM_LOGITS]


class SplitTarget:
    """The verbs every split target shares: prefix (with or without the early exit), suffix, forward.

    A subclass has `prefix` and `suffix` graphs its cache runs (graphs 0 and 1; the prefix outputs "hidden", and
    "exit_hidden" for an attention exit adapter) and a stateless `_exit(hidden)` -> ids, log-probs [T, kappa]. The
    pending hidden state waits in `cache.hidden`: `forward_suffix` must follow each `forward_prefix`.
    """

    def forward_prefix_only(self, tokens: Sequence[int], cache) -> None:
        """Layers 0..exit-1 over tokens [T], no early exit; the hidden state waits for `forward_suffix`."""
        self._run_prefix(tokens, cache)

    def _run_prefix(self, tokens: Sequence[int], cache) -> dict:
        if cache.hidden is not None:
            raise RuntimeError("forward_prefix called again before forward_suffix")
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        out = cache.run(0, self.prefix, ids)
        cache.hidden = out["hidden"]
        return out

    def forward_prefix(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """Layers 0..exit-1 over tokens [T] -> early-exit (ids [T, kappa], log-probs [T, kappa])."""
        out = self._run_prefix(tokens, cache)
        return self._exit(out.get("exit_hidden", out["hidden"]))

    def forward_suffix(self, cache, last_rows: int | None = None) -> np.ndarray:
        """Layers exit..N-1 over the pending hidden state -> logits [T, vocab] (or its last `last_rows`)."""
        if cache.hidden is None:
            raise RuntimeError("forward_suffix called without a pending forward_prefix")
        hidden, cache.hidden = cache.hidden, None
        logits = cache.run(1, self.suffix, hidden, last_rows)["logits"]
        return logits[-last_rows:] if last_rows else logits

    def forward(self, tokens: Sequence[int], cache, last_rows: int | None = None) -> np.ndarray:
        """tokens [T] -> logits [T, vocab] or its last `last_rows` (prefix then suffix, no exit); advances by T."""
        self.forward_prefix_only(tokens, cache)
        return self.forward_suffix(cache, last_rows)

    def forward_last(self, tokens: Sequence[int], cache) -> np.ndarray:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        return self.forward(tokens, cache, last_rows=1)


def lazy_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero-filled array whose pages are committed 4 KB at a time as they are first written."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, size)  # anonymous: zero-filled, committed on first write
    try:
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:  # refused: huge pages then, as numpy's would be
        pass
    return np.frombuffer(memory, dtype=dtype).reshape(shape)  # the array keeps the mapping alive
