"""ONNX Runtime backend: the .onnx graphs of a bundle on any execution provider (onnxruntime imported lazily).

Explicit-KV graphs take the KV as inputs and return it grown (host arrays; rollback slices them). Shared-KV graphs
(`--kv shared`, exporters.shared_kv) write the window's KV in place into buffers bound as both past and present: no
copy, rollback is a count. Between calls every graph of a cache holds `length` positions, except that the suffix lags
from `forward_prefix` to `forward_suffix`; the exit graph is stateless.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from mirror_rt.devices.base import GraphCache, GraphModel, SplitTarget
from mirror_rt.devices.onnxruntime.pool import RowPool
from mirror_rt.devices.onnxruntime.session import create_session
from mirror_rt.exporters.native_op import ATTENTION, call_threads, register
from mirror_rt.runtime.affinity import available_cores, on_two_cores, pin, restore
from mirror_rt.runtime.backend import Capabilities

PREFILL_CHUNK = 64  # prompt tokens per pipelined prefill stage
LAST_ROWS = "last_rows"  # optional graph input (exporters.split.LAST_ROWS): logits rows from the window's end
TOTAL_LEN = "total_len"  # input of shared-KV graphs (exporters.shared_kv.TOTAL_LEN)
ROWS_APART = 1 << 16  # attention_groups of pool graphs: as many as rows
GROUPS = "attention_groups"  # input of exact graphs since format 6 (exporters.exact_kv.GROUPS_INPUT)

# Short provider names of device strings (`ort:qnn`) -> ONNX Runtime execution providers.
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "qnn": "QNNExecutionProvider",
             "openvino": "OpenVINOExecutionProvider", "dml": "DmlExecutionProvider",
             "coreml": "CoreMLExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError("the ONNX Runtime backend needs the 'onnxruntime' package (pip install onnxruntime)") from exc
    return onnxruntime


def session_options(threads: int | None):
    """One intra-op pool of `threads`, no inter-op pool, no spinning (an idle worker leaves its cores to the other)."""
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads:
        options.intra_op_num_threads = int(threads)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    register(options, threads)  # mirror-rt's ops (exporters.native_op), where they build
    return options


class ORTGraph:
    """One ONNX Runtime session over a graph with explicit KV, or KV in shared buffers (`shared_kv`)."""

    def __init__(self, path: Path, provider: str = "cpu", kv_shape: tuple[int, int] = (1, 1),
                 threads: int | None = None):
        _onnxruntime()  # its clear error where onnxruntime is missing
        providers = [PROVIDERS.get(provider, provider)]
        if providers[0] != "CPUExecutionProvider":
            providers.append("CPUExecutionProvider")  # ops the EP does not take
        self.session = create_session(Path(path), providers, lambda: session_options(threads))
        self.threads = threads  # mirror-rt's ops in this session's calls use as many (exporters.native_op)
        inputs = {i.name: i for i in self.session.get_inputs()}
        names = list(inputs)
        self.input_name = names[0]
        self.takes_last_rows = LAST_ROWS in names  # logits graphs of bundles since format 3
        self.shared_kv = TOTAL_LEN in names
        self.past_names = [n for n in names[1:] if n not in (LAST_ROWS, TOTAL_LEN, GROUPS)]
        self.groups = inputs[GROUPS].shape[0] if GROUPS in inputs else 0  # attention groups of rows (format 6)
        # pool graphs (format 7, exporters.pool_kv): each row reads its own keys, whatever its companions' lengths
        self.rows_apart = self.session.get_modelmeta().custom_metadata_map.get(ATTENTION) == "pool"
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.n_head_outputs = len(self.output_names) - len(self.past_names)
        self.kv_shape = kv_shape  # (kv_heads, head_dim)
        half = self.past_names and inputs[self.past_names[0]].type == "tensor(float16)"  # pool graphs' --kv-dtype
        self.kv_dtype = np.float16 if half else np.float32
        # batched shared-KV graphs (exporters.shared_kv) take rows: ids [B, T] / hidden [B, T, hidden]
        self.batched = self.shared_kv and len(inputs[names[0]].shape) == (2 if self.input_name == "input_ids" else 3)

    def empty_kv(self, capacity: int) -> list:
        """Explicit: zero-length arrays. Shared: (buffers [1, KVH, capacity, D], their OrtValues)."""
        shape = (1, self.kv_shape[0], capacity if self.shared_kv else 0, self.kv_shape[1])
        buffers = [np.zeros(shape, dtype=self.kv_dtype) for _ in self.past_names]
        if not self.shared_kv:
            return buffers
        ort = _onnxruntime()
        return [(b, ort.OrtValue.ortvalue_from_numpy(b)) for b in buffers]  # the OrtValues share the memory

    def run(self, x: np.ndarray, kv: list, last_rows: int | None = None, start: int = 0) -> tuple[dict, list]:
        """x [T] ids or [T, hidden] at positions start.. -> (head outputs by name, the kv after the call); `last_rows`:
        logits of the window's last rows only (graphs that take it)."""
        extra = {LAST_ROWS: np.array([last_rows or len(x)], dtype=np.int64)} if self.takes_last_rows else {}
        if self.batched:  # one row of a batched graph
            values = [value for _, value in kv]
            head = self.run_rows(x[None], values, np.array([start + len(x)], dtype=np.int32), last_rows)
            return {name: out[0] for name, out in head.items()}, kv
        if self.shared_kv:
            return self._run_shared(x, kv, extra | {TOTAL_LEN: np.array([start + len(x)], dtype=np.int32)})
        call_threads(self.threads)
        outputs = self.session.run(self.output_names, {self.input_name: x, **dict(zip(self.past_names, kv))} | extra)
        head = dict(zip(self.output_names[:self.n_head_outputs], outputs[:self.n_head_outputs]))
        return head, outputs[self.n_head_outputs:]

    def run_rows(self, x: np.ndarray, values: list, total_len: np.ndarray, last_rows: int | None = None,
                 groups: np.ndarray | None = None) -> dict:
        """Batched graphs: x [B, T] ids or [B, T, hidden] over KV buffers `values` (OrtValues [B, KVH, S, D] per past
        input, written in place), total_len [B] int32 (positions per row after the call) -> head outputs [B, ...] by
        name. `groups` [self.groups, 2]: (row end, keys read) per group of rows (None: one group)."""
        feeds = {TOTAL_LEN: total_len}
        if self.groups:
            feeds[GROUPS] = groups if groups is not None else one_group(total_len, self.groups)
        if self.takes_last_rows:
            feeds[LAST_ROWS] = np.array([last_rows or x.shape[1]], dtype=np.int64)
        return self._run_shared(x, values, feeds)[0]

    def _run_shared(self, x: np.ndarray, kv: list, feeds: dict) -> tuple[dict, list]:
        """Run with `kv` bound as both past and present (OrtValues, or (buffer, OrtValue) pairs)."""
        binding = self.session.io_binding()
        for name, value in ({self.input_name: np.ascontiguousarray(x)} | feeds).items():
            binding.bind_cpu_input(name, value)
        heads = self.output_names[:self.n_head_outputs]
        for name in heads:
            binding.bind_output(name, "cpu")
        for past, present, item in zip(self.past_names, self.output_names[self.n_head_outputs:], kv):
            value = item[1] if isinstance(item, tuple) else item
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        call_threads(self.threads)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: outputs[i].numpy() for i, name in enumerate(heads)}, kv


def one_group(total_len: np.ndarray, groups: int) -> np.ndarray:
    """Attention groups [groups, 2] with every row in the first (the others empty)."""
    rows = len(total_len)
    return np.array([[rows, int(total_len.max())]] + [[rows, 1]] * (groups - 1), dtype=np.int64)


class ORTCache(GraphCache):
    """The KV of one or more graphs of the same model: host arrays (explicit) or shared buffers."""

    def __init__(self, graphs: list[ORTGraph], capacity: int):
        super().__init__(len(graphs), capacity)
        self.kv = [g.empty_kv(capacity) for g in graphs]  # per graph: [key0, value0, ...] (see ORTGraph.empty_kv)
        self.shared = graphs[0].shared_kv

    def run(self, index: int, graph: ORTGraph, x: np.ndarray, last_rows: int | None = None) -> dict:
        """Run graph `index` of this cache over x after its positions; returns its head outputs."""
        head, self.kv[index] = graph.run(x, self.kv[index], last_rows, self.filled[index])
        self.filled[index] += len(x)
        return head

    def rollback(self, length: int) -> None:
        """Forget positions >= length in every graph (explicit: array views; shared: a count). O(1)."""
        self.check_rollback(length)
        if not self.shared:
            self.kv = [[a[:, :, :length] for a in kv] for kv in self.kv]
        self.filled = [min(f, length) for f in self.filled]
        self.keep_hidden(length, self.filled[-1])


class ORTModel(GraphModel):
    """A `LoadedModel` over one graph (a draft or an unsplit target); batched shared-KV graphs run rows at once."""

    def __init__(self, graph: ORTGraph, vocab_size: int, max_seq_len: int, wide_graph: ORTGraph | None = None):
        streams = graph.session.get_modelmeta().custom_metadata_map.get("n_streams")
        super().__init__(graph, vocab_size, max_seq_len, int(streams) if streams else None, rows=graph.batched)
        self.wide_graph = wide_graph  # the same graph's session over every core (a draft's spread steps)
        self.capabilities = replace(self.capabilities, wide=wide_graph is not None and graph.batched)

    def new_cache(self, capacity: int) -> ORTCache:
        return ORTCache([self.graph], min(capacity, self.max_seq_len))

    def new_pool(self, rows: int, capacity: int) -> RowPool:
        """KV rows for `rows` sequences of up to `capacity` positions (devices.onnxruntime.pool)."""
        return RowPool([self.graph], rows, capacity)

    def forward_rows(self, tokens: np.ndarray, pool: RowPool, first: int, last_rows: int | None = None,
                     wide: bool = False) -> np.ndarray:
        """tokens [B, T] at each row's length, rows first..first+B-1 -> logits [B, T or last_rows, vocab]; `wide`:
        through the session over every core where there is one."""
        graph = self.wide_graph if wide and self.wide_graph else self.graph
        return pool.run(0, graph, np.asarray(tokens, dtype=np.int64), first, last_rows)["logits"]

    def can_adopt(self, target) -> bool:
        """Whether this draft's pool takes `target`'s pool rows: an ONNX Runtime target, shared buffers from shared."""
        graph = getattr(target, "prefix", getattr(target, "graph", None))
        return isinstance(graph, ORTGraph) and (graph.shared_kv or not self.graph.shared_kv)


class ORTSplitTarget(SplitTarget):
    """The target as prefix + suffix sessions (one cache) and a stateless exit session that `forward` never runs."""

    def __init__(self, prefix: ORTGraph, exit_graph: ORTGraph, suffix: ORTGraph, vocab_size: int, max_seq_len: int,
                 kappa: int, prompt_graphs: list[ORTGraph] | None = None):
        self.prefix, self.exit, self.suffix = prefix, exit_graph, suffix
        self.prompt_graphs = prompt_graphs  # (prefix, suffix) sessions over more cores, for prompts
        self.vocab_size, self.max_seq_len, self.kappa = vocab_size, max_seq_len, kappa
        # rows of sequences at once where both halves take them (not with an attention exit adapter); the groups of
        # rows a call attends apart (exporters.exact_kv, format 6; pool graphs: every row apart)
        rows = prefix.batched and suffix.batched and "exit_hidden" not in prefix.output_names
        groups = ROWS_APART if prefix.rows_apart and suffix.rows_apart else min(prefix.groups, suffix.groups)
        self.capabilities = Capabilities(split=True, rows=rows, attention_groups=groups, split_rows=rows,
                                         wide=prompt_graphs is not None, pipelined=True, two_calls=True)

    def new_cache(self, capacity: int) -> ORTCache:
        return ORTCache([self.prefix, self.suffix], min(capacity, self.max_seq_len))

    def new_pool(self, rows: int, capacity: int) -> RowPool:
        """KV rows of prefix and suffix for `rows` sequences (devices.onnxruntime.pool)."""
        return RowPool([self.prefix, self.suffix], rows, capacity)

    def forward_rows(self, tokens: np.ndarray, pool: RowPool, first: int, last_rows: int | None = None,
                     wide: bool = False) -> np.ndarray:
        """Prefix then suffix, no early exit: tokens [B, T] -> logits [B, T or last_rows, vocab]; `wide`: through the
        prompt sessions (every core) where the target has them."""
        prefix, suffix = self.prompt_graphs if wide and self.prompt_graphs else (self.prefix, self.suffix)
        hidden = pool.run(0, prefix, np.asarray(tokens, dtype=np.int64), first)["hidden"]
        return pool.run(1, suffix, hidden, first, last_rows)["logits"]

    def forward_rows_prefix(self, tokens: np.ndarray, pool: RowPool, first: int,
                            exits: dict[int, int]) -> tuple[np.ndarray, dict]:
        """The prefix over rows first..first+B-1 (tokens [B, T]) -> (hidden [B, T, hidden] for `forward_rows_suffix`,
        {row: early exit (ids, log-probs) [n, kappa]} of the first n positions of each row of `exits` {row: n}, in
        one exit call)."""
        hidden = pool.run(0, self.prefix, np.asarray(tokens, dtype=np.int64), first)["hidden"]
        if not exits:
            return hidden, {}
        rows = sorted(exits)
        ids, logprobs = self._exit(np.concatenate([hidden[r, :exits[r]] for r in rows]))
        ends = np.cumsum([exits[r] for r in rows])
        return hidden, {r: (ids[end - exits[r]:end], logprobs[end - exits[r]:end]) for r, end in zip(rows, ends)}

    def forward_rows_suffix(self, hidden: np.ndarray, pool: RowPool, first: int) -> np.ndarray:
        """The suffix over the rows `forward_rows_prefix` ran -> logits [B, T, vocab]; no advance (the caller
        commits)."""
        return pool.run(1, self.suffix, hidden, first)["logits"]

    def forward_rows_split(self, tokens: np.ndarray, pool: RowPool, cut: int, cpus: tuple[int, int],
                           first: int = 0) -> np.ndarray:
        """The pool's rows first.. (tokens [B, T]) as two calls at once (runtime.batch.splits): the first `cut` on
        cpus[0], the others on cpus[1], through the one-thread sessions -> logits [B, T, vocab], the same bits as one
        call."""
        tokens = np.asarray(tokens, dtype=np.int64)
        head, tail = self._on_two_cores(lambda: self.forward_rows(tokens[:cut], pool, first),
                                        lambda: self.forward_rows(tokens[cut:], pool, first + cut), cpus)
        return np.concatenate([head, tail])

    def prefill_split(self, chunks: list, caches: list, cpus: tuple[int, int]) -> list[np.ndarray]:
        """Two prompts' chunks at once, chunks[i] into caches[i] on cpus[i] -> each's last logits [1, vocab] (the same
        bits as one prompt at a time)."""
        return list(self._on_two_cores(lambda: self.forward_last(chunks[0], caches[0]),
                                       lambda: self.forward_last(chunks[1], caches[1]), cpus))

    def _on_two_cores(self, first, second, cpus: tuple[int, int]) -> tuple:
        """(first(), second()) at once: `first` here pinned to cpus[0], `second` in a helper thread pinned to cpus[1],
        waited for even when `first` fails (both write into the pool). Unequal shares (a Mirror target's N-1 cores, the
        draft's one): one after the other on the target's cores, where the slower half would not hold the other."""
        if not isinstance(cpus[0], int) and len(cpus[0]) != len(cpus[1]):
            previous = pin(cpus[0])
            try:
                return first(), second()
            finally:
                restore(previous)
        return on_two_cores(first, second, cpus)

    def _exit(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        head, _ = self.exit.run(hidden, [])
        return head["exit_ids"], head["exit_logprobs"]

    def prefill_pipelined(self, tokens: Sequence[int], cache: ORTCache, cpu: int | None,
                          chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """A prompt on two cores -> the last position's logits [1, vocab]: through `prompt_graphs` (a thread per core)
        where the target has them; straight through on this thread where it is not pinned to one core and no helper
        core is named (its products split over its cores); else prefix chunks here while a helper pinned to `cpu`
        runs the previous chunk's suffix. Each graph sees its calls in order, so the cache ends as after `forward`."""
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        if cache.hidden is not None:
            raise RuntimeError("prefill_pipelined called with a pending forward_suffix")
        if self.prompt_graphs:
            prefix, suffix = self.prompt_graphs
            return cache.run(1, suffix, cache.run(0, prefix, ids)["hidden"], last_rows=1)["logits"][-1:]
        if cpu is None and len(available_cores()) > 1:
            # this thread is not pinned to one core: its products share their rows out over its cores, where a
            # pipeline of two one-thread halves waited for the slower one (a 7B's 256-token prompt on two cores:
            # 7.3-8.9 s direct, 10.3-10.6 s pipelined)
            return cache.run(1, self.suffix, cache.run(0, self.prefix, ids)["hidden"], last_rows=1)["logits"][-1:]
        handoff: queue.Queue = queue.Queue()
        result: dict = {}
        helper = threading.Thread(target=self._suffix_chunks, args=(handoff, cache, cpu, result),
                                  name="mirror-prefill", daemon=True)
        helper.start()
        try:
            for start in range(0, len(ids), chunk):
                if "error" in result:
                    break
                handoff.put(cache.run(0, self.prefix, ids[start:start + chunk])["hidden"])
        finally:
            handoff.put(None)
            helper.join()
        if "error" in result:
            raise result["error"]
        return result["logits"]

    def _suffix_chunks(self, handoff: queue.Queue, cache: ORTCache, cpu: int | None, result: dict) -> None:
        pin(cpu)
        while (hidden := handoff.get()) is not None:
            if "error" in result:
                continue  # drain until the end marker
            try:
                result["logits"] = cache.run(1, self.suffix, hidden, last_rows=1)["logits"][-1:]
            except Exception as exc:  # re-raised in the caller's thread
                result["error"] = exc
