"""OpenVINO backend: stateful graphs of a bundle on CPU, GPU or NPU (ONNX graphs made stateful at load; openvino
imported lazily). A cache is one infer request per graph whose state holds the KV; rollback trims each state (dynamic
graphs) or moves `length` back (static graphs write KV at `position`). Between calls every graph of a cache holds
`length` positions, except that the suffix lags from `forward_prefix` to `forward_suffix`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mirror_rt.devices.base import STREAM_LOGITS, GraphCache, GraphModel, SplitTarget
from mirror_rt.runtime.backend import Capabilities

LAST_ROWS = "last_rows"  # optional graph input (exporters.split.LAST_ROWS): logits rows from the window's end


def _openvino():
    try:
        import openvino as ov
    except ImportError as exc:
        raise ImportError("the OpenVINO backend needs the 'openvino' package (pip install openvino)") from exc
    return ov


def compile_config(device: str, threads: int | None, pinned: bool = False, precision: str | None = None) -> dict:
    """compile_model properties: latency, one stream, and on the CPU f32 math and KV unless `precision` says otherwise
    (the plugin's bf16 / u8 defaults on bf16 machines would change the target's greedy output; a draft may run bf16)."""
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if device.upper().startswith("CPU"):
        config |= {"NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": precision or "f32", "KV_CACHE_PRECISION": "f32"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        if pinned:  # the worker chose its cores: do not let the plugin re-pin its threads
            config["ENABLE_CPU_PINNING"] = False
    return config


class OVGraph:
    """One compiled graph. Requests made from it each own an independent KV state."""

    def __init__(self, path: Path, device: str, kv_shape: tuple[int, int], threads: int | None = None,
                 window: int = 0, pinned: bool = False, precision: str | None = None):
        ov = _openvino()
        core = ov.Core()
        model = core.read_model(str(path))
        if any(name.startswith("past_key.") for p in model.inputs for name in p.get_names()):
            _make_stateful(model, kv_shape)  # an ONNX graph: fold its explicit KV into state
        self.compiled = core.compile_model(model, device, compile_config(device, threads, pinned, precision))
        self.window = window  # static graphs: tokens per call (inputs padded to it); 0 = dynamic
        self.input_name = self.compiled.inputs[0].get_any_name()
        self.takes_position = any("position" in p.get_names() for p in self.compiled.inputs)  # static KV graphs
        self.takes_last_rows = any(LAST_ROWS in p.get_names() for p in self.compiled.inputs)  # format >= 3
        self.output_names = [o.get_any_name() for o in self.compiled.outputs]

    def new_request(self):
        return self.compiled.create_infer_request()

    def run(self, request, x: np.ndarray, start: int, last_rows: int | None = None) -> dict[str, np.ndarray]:
        """Feed x [T] ids or [T, hidden] at positions start..; returns host copies of the outputs (`last_rows`: logits
        of the window's last rows only, dynamic graphs that take it)."""
        if not self.window:
            feeds = {self.input_name: x}
            if self.takes_last_rows:
                feeds[LAST_ROWS] = np.array([last_rows or len(x)], dtype=np.int64)
            request.infer(feeds)
            return {n: request.get_tensor(n).data.copy() for n in self.output_names}
        parts = []
        for s in range(0, len(x), self.window):  # static: windows padded to the fixed shape
            chunk = x[s:s + self.window]
            padded = np.zeros((self.window,) + x.shape[1:], dtype=x.dtype)
            padded[:len(chunk)] = chunk
            feeds = {self.input_name: padded}
            if self.takes_position:
                feeds["position"] = np.array([start + s], dtype=np.int64)
            request.infer(feeds)
            parts.append({n: request.get_tensor(n).data[:len(chunk)].copy() for n in self.output_names})
        return {n: np.concatenate([p[n] for p in parts]) for n in self.output_names}


def _make_stateful(model, kv_shape: tuple[int, int]) -> None:
    ov = _openvino()
    from openvino._offline_transformations import apply_make_stateful_transformation

    past = [p.get_any_name() for p in model.inputs if p.get_any_name().startswith("past_")]
    model.reshape({n: ov.PartialShape([1, kv_shape[0], -1, kv_shape[1]]) for n in past})
    apply_make_stateful_transformation(model, {n: n.replace("past_", "present_", 1) for n in past})


class OVCache(GraphCache):
    """KV state of one or more infer requests (one per graph of the same model)."""

    def __init__(self, requests: list, capacity: int, static: bool):
        super().__init__(len(requests), capacity)
        self.requests, self.static = requests, static

    def run(self, index: int, graph: OVGraph, x: np.ndarray, last_rows: int | None = None) -> dict:
        """Graph `index` of this cache over x after its positions; returns its outputs."""
        out = graph.run(self.requests[index], x, self.filled[index], last_rows)
        self.filled[index] += len(x)
        return out

    def rollback(self, length: int) -> None:
        """Forget positions >= length in every graph: trim each state (dynamic) or O(1) (static)."""
        self.check_rollback(length)
        for i, request in enumerate(self.requests):
            if self.filled[i] > length:
                if not self.static:
                    _trim(request, length)
                self.filled[i] = length
        self.keep_hidden(length, self.filled[-1])


def _trim(request, length: int) -> None:
    """Cut every state tensor of `request` to `length` positions (axis 2, BHTD)."""
    ov = _openvino()
    for state in request.query_state():
        tensor = state.state
        shape = list(tensor.shape)
        if shape[2] > length:
            end = shape[:2] + [length] + shape[3:]
            state.state = ov.Tensor(tensor, [0, 0, 0, 0], end)


class OVModel(GraphModel):
    """A `LoadedModel` over one stateful graph (the draft, an SS draft's too, or an unsplit target)."""

    def __init__(self, graph: OVGraph, vocab_size: int, max_seq_len: int):
        n_streams = None
        if STREAM_LOGITS in graph.output_names:  # its stream count, where the graph's shape fixes it
            shape = graph.compiled.outputs[graph.output_names.index(STREAM_LOGITS)].get_partial_shape()[1]
            n_streams = shape.get_length() if shape.is_static else None
        super().__init__(graph, vocab_size, max_seq_len, n_streams)

    def new_cache(self, capacity: int) -> OVCache:
        return OVCache([self.graph.new_request()], min(capacity, self.max_seq_len), bool(self.graph.window))


class OVSplitTarget(SplitTarget):
    """The target as prefix + suffix graphs (one cache) and a stateless exit graph that `forward` never runs; one exit
    request serves every cache, so calls must not overlap (one target worker)."""

    def __init__(self, prefix: OVGraph, exit_graph: OVGraph, suffix: OVGraph, vocab_size: int, max_seq_len: int,
                 kappa: int):
        self.prefix, self.exit, self.suffix = prefix, exit_graph, suffix
        self.exit_request = exit_graph.new_request()  # stateless: nothing to keep per cache
        self.vocab_size, self.max_seq_len, self.kappa = vocab_size, max_seq_len, kappa
        self.capabilities = Capabilities(split=True)

    def new_cache(self, capacity: int) -> OVCache:
        requests = [self.prefix.new_request(), self.suffix.new_request()]
        return OVCache(requests, min(capacity, self.max_seq_len), bool(self.prefix.window))

    def _exit(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.exit.run(self.exit_request, hidden, 0)
        return out["exit_ids"], out["exit_logprobs"]
