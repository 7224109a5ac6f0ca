"""ONNX Runtime backend: the .onnx graphs of a bundle on any execution provider.

ONNX graphs take the KV cache as explicit inputs and return it grown by the window, so
the cache is a list of host arrays per graph; rollback slices them (O(1), views). This
costs a copy of the whole cache per call, the price of running on any EP (CPU, CUDA,
QNN, OpenVINO). onnxruntime is imported lazily; the runtime core never imports it.
Invariant: between calls every graph of a cache holds exactly `length` positions, except
that after `forward_prefix` the suffix lags until `forward_suffix` runs. The split target's
exit graph is stateless and belongs to no cache.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mirror_rt.devices.base import CacheBounds, pin_thread

PREFILL_CHUNK = 64  # prompt tokens per pipelined prefill stage
LAST_ROWS = "last_rows"  # optional graph input (exporters.split.LAST_ROWS): logits rows from the window's end

# Short provider names of device strings (`ort:qnn`) -> ONNX Runtime execution providers.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "qnn": "QNNExecutionProvider",
             "openvino": "OpenVINOExecutionProvider", "dml": "DmlExecutionProvider",
             "coreml": "CoreMLExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError("the ONNX Runtime backend needs the 'onnxruntime' package "
                          "(pip install onnxruntime)") from exc
    return onnxruntime


def session_options(threads: int | None):
    """One intra-op pool of `threads`, no inter-op pool, no spinning.

    Spinning is off so that an idle worker leaves its cores to the other worker (target and
    draft share the machine); it costs a little latency on a quiet machine.
    """
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads:
        options.intra_op_num_threads = int(threads)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class ORTGraph:
    """One ONNX Runtime session over a graph with explicit KV inputs and outputs."""

    def __init__(self, path: Path, provider: str = "cpu", kv_shape: tuple[int, int] = (1, 1),
                 threads: int | None = None):
        ort = _onnxruntime()
        providers = [PROVIDERS.get(provider, provider)]
        if providers[0] != "CPUExecutionProvider":
            providers.append("CPUExecutionProvider")  # ops the EP does not take
        self.session = ort.InferenceSession(str(path), session_options(threads), providers=providers)
        names = [i.name for i in self.session.get_inputs()]
        self.input_name = names[0]
        self.takes_last_rows = LAST_ROWS in names  # logits graphs of bundles since format 3
        self.past_names = [n for n in names[1:] if n != LAST_ROWS]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.n_head_outputs = len(self.output_names) - len(self.past_names)
        self.kv_shape = kv_shape  # (kv_heads, head_dim)

    def empty_kv(self) -> list[np.ndarray]:
        shape = (1, self.kv_shape[0], 0, self.kv_shape[1])
        return [np.zeros(shape, dtype=np.float32) for _ in self.past_names]

    def run(self, x: np.ndarray, kv: list[np.ndarray], last_rows: int | None = None) -> tuple[dict, list[np.ndarray]]:
        """x [T] ids or [T, hidden] after `kv` -> (head outputs by name, grown kv).

        `last_rows`: logits for the window's last rows only (graphs that take it; others return all rows).
        """
        feeds = {self.input_name: x, **dict(zip(self.past_names, kv))}
        if self.takes_last_rows:
            feeds[LAST_ROWS] = np.array([last_rows or len(x)], dtype=np.int64)
        outputs = self.session.run(self.output_names, feeds)
        head = dict(zip(self.output_names[:self.n_head_outputs], outputs[:self.n_head_outputs]))
        return head, outputs[self.n_head_outputs:]


class ORTCache(CacheBounds):
    """Host KV arrays of one or more graphs of the same model."""

    def __init__(self, graphs: list[ORTGraph], capacity: int):
        self.kv = [g.empty_kv() for g in graphs]  # per graph: [key0, value0, ...] each [1, KVH, L, D]
        self.capacity = capacity
        self.hidden: np.ndarray | None = None  # split target: prefix rows the suffix has not seen

    @property
    def length(self) -> int:
        """Positions committed (by the first graph; the suffix may lag by `hidden` rows)."""
        return self.kv[0][0].shape[2]

    def rollback(self, length: int) -> None:
        """Forget positions >= length in every graph (array views, O(1))."""
        self.check_rollback(length)
        self.kv = [[a[:, :, :length] for a in kv] for kv in self.kv]
        if self.hidden is not None:  # keep the pending rows that survive the rollback
            keep = length - self.kv[-1][0].shape[2]
            self.hidden = self.hidden[:keep] if keep > 0 else None


class ORTModel:
    """A `LoadedModel` over one graph (the draft, or an unsplit target)."""

    def __init__(self, graph: ORTGraph, vocab_size: int, max_seq_len: int):
        self.graph = graph
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len

    def new_cache(self, capacity: int) -> ORTCache:
        return ORTCache([self.graph], min(capacity, self.max_seq_len))

    def forward(self, tokens: Sequence[int], cache: ORTCache) -> np.ndarray:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        head, cache.kv[0] = self.graph.run(ids, cache.kv[0])
        return head["logits"]

    def forward_last(self, tokens: Sequence[int], cache: ORTCache) -> np.ndarray:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        head, cache.kv[0] = self.graph.run(ids, cache.kv[0], last_rows=1)
        return head["logits"][-1:]

    def adopt(self, target_cache: ORTCache, capacity: int) -> ORTCache:
        """A cache over the split target's KV arrays, all layers in order (shared: arrays are never written)."""
        if target_cache.hidden is not None:
            raise RuntimeError("cannot adopt a target cache with a pending forward_suffix")
        arrays = [a for kv in target_cache.kv for a in kv]
        if len(arrays) != len(self.graph.past_names) or arrays[0].shape[1::2] != tuple(self.graph.kv_shape):
            raise ValueError("cannot adopt a cache of another shape (the draft is not a copy of the target)")
        cache = self.new_cache(capacity)
        cache.check_room(target_cache.length)
        cache.kv = [arrays]
        return cache


class ORTSplitTarget:
    """The target as prefix + suffix sessions with a stateless early-exit session, one cache for both.

    `forward` never runs the exit session: target-only decoding pays for the prefix and suffix only.

    Limitations:
    - `forward_suffix` must follow each `forward_prefix` before the next prefix call.
    """

    def __init__(self, prefix: ORTGraph, exit_graph: ORTGraph, suffix: ORTGraph, vocab_size: int, max_seq_len: int,
                 kappa: int):
        self.prefix, self.exit, self.suffix = prefix, exit_graph, suffix
        self.vocab_size, self.max_seq_len, self.kappa = vocab_size, max_seq_len, kappa

    def new_cache(self, capacity: int) -> ORTCache:
        return ORTCache([self.prefix, self.suffix], min(capacity, self.max_seq_len))

    def forward_prefix_only(self, tokens: Sequence[int], cache: ORTCache) -> None:
        """Layers 0..exit-1 over tokens [T], no early exit; the hidden state waits for `forward_suffix`."""
        if cache.hidden is not None:
            raise RuntimeError("forward_prefix called again before forward_suffix")
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        head, cache.kv[0] = self.prefix.run(ids, cache.kv[0])
        cache.hidden = head["hidden"]

    def forward_prefix(self, tokens: Sequence[int], cache: ORTCache) -> tuple[np.ndarray, np.ndarray]:
        """Layers 0..exit-1 over tokens [T] -> early-exit (ids [T, kappa], log-probs [T, kappa])."""
        self.forward_prefix_only(tokens, cache)
        head, _ = self.exit.run(cache.hidden, [])
        return head["exit_ids"], head["exit_logprobs"]

    def forward_suffix(self, cache: ORTCache, last_rows: int | None = None) -> np.ndarray:
        """Layers exit..N-1 over the pending hidden state -> logits [T, vocab] (or its last `last_rows`)."""
        if cache.hidden is None:
            raise RuntimeError("forward_suffix called without a pending forward_prefix")
        head, cache.kv[1] = self.suffix.run(cache.hidden, cache.kv[1], last_rows)
        cache.hidden = None
        return head["logits"][-last_rows:] if last_rows else head["logits"]

    def forward(self, tokens: Sequence[int], cache: ORTCache) -> np.ndarray:
        """tokens [T] -> logits [T, vocab] (prefix then suffix, no early exit); advances the cache by T."""
        self.forward_prefix_only(tokens, cache)
        return self.forward_suffix(cache)

    def forward_last(self, tokens: Sequence[int], cache: ORTCache) -> np.ndarray:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        self.forward_prefix_only(tokens, cache)
        return self.forward_suffix(cache, last_rows=1)

    def prefill_pipelined(self, tokens: Sequence[int], cache: ORTCache, cpu: int | None,
                          chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """A prompt on two cores: prefix chunks in this thread, suffix chunks in a helper pinned to `cpu`.

        While the suffix runs chunk i, the prefix runs chunk i+1; each graph still sees its own
        calls in order, so the cache ends as after `forward`. Returns the last position's logits [1, vocab].
        """
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        if cache.hidden is not None:
            raise RuntimeError("prefill_pipelined called with a pending forward_suffix")
        handoff: queue.Queue = queue.Queue()
        result: dict = {}
        helper = threading.Thread(target=self._suffix_chunks, args=(handoff, cache, cpu, result),
                                  name="mirror-prefill", daemon=True)
        helper.start()
        try:
            for start in range(0, len(ids), chunk):
                if "error" in result:
                    break
                head, cache.kv[0] = self.prefix.run(ids[start:start + chunk], cache.kv[0])
                handoff.put(head["hidden"])
        finally:
            handoff.put(None)
            helper.join()
        if "error" in result:
            raise result["error"]
        return result["logits"]

    def _suffix_chunks(self, handoff: queue.Queue, cache: ORTCache, cpu: int | None, result: dict) -> None:
        pin_thread(cpu)
        while (hidden := handoff.get()) is not None:
            if "error" in result:
                continue  # drain until the end marker
            try:
                head, cache.kv[1] = self.suffix.run(hidden, cache.kv[1], last_rows=1)
                result["logits"] = head["logits"][-1:]
            except Exception as exc:  # re-raised in the caller's thread
                result["error"] = exc
