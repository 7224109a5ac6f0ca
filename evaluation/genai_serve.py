"""OpenVINO GenAI's `ContinuousBatchingPipeline` as a peer of `mirror-rt bench-serve`, run in this process as OVMS
drives it (`add_request`, then `step` in a loop keeping `concurrency` requests in flight). A request's clock starts at
`add_request` and a token's time is the end of the step that made it, so the figures mean what serve_bench's do,
minus HTTP and tokenization. Prompts go in as the server's token ids, greedy, `ignore_eos`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mirror_rt.evaluation.serve_bench import Result

# peer name -> OpenVINO properties beyond the thread count (f32: the precision of our fp32 rows)
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "KEY_CACHE_PRECISION": "f32",
       "VALUE_CACHE_PRECISION": "f32"}
PEERS = {"ov-genai-cb": {}, "ov-genai-cb-f32": F32}
SHORT = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "u8": "u8", "i8": "i8", "u4": "u4"}


@dataclass
class Flight:
    """One request in flight: its handle, when it started, its tokens so far and their arrival gaps."""

    handle: object
    start: float
    ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def collect(self, now: float) -> None:
        """Take the tokens the last step made; a gap spread over several tokens counts once per token."""
        new = self.new_ids()
        if not new:
            return
        if not self.ids:  # as over HTTP: the first step's tokens set TTFT, later steps' tokens the gaps
            self.ttft = now - self.start
        else:
            self.gaps += [(now - self.last_at) / len(new)] * len(new)
        self.ids += new
        self.last_at = now

    def new_ids(self) -> list[int]:
        """The tokens the handle holds that this flight has not taken yet."""
        if not self.handle.can_read():
            return []
        return [t for output in self.handle.read().values() for t in output.generated_ids]

    def finished(self) -> bool:
        return self.handle.get_status().name != "RUNNING"

    def succeeded(self) -> bool:
        return self.handle.get_status().name == "FINISHED"

    def result(self, now: float) -> Result:
        ok = self.succeeded() and bool(self.ids)
        return Result(ok=ok, status=200 if ok else 500, ttft=self.ttft, e2e=now - self.start, tokens=len(self.ids),
                      token_gaps=self.gaps)


class ContinuousBatchingPeer:
    """A `ContinuousBatchingPipeline` at one precision, run closed-loop level by level."""

    where = "in process (no HTTP)"

    def __init__(self, name: str, pipe, precision: dict, threads: int):
        self.name, self.pipe, self.precision, self.threads = name, pipe, precision, threads
        self.precision_label = f"{precision['weights']} weights, {precision['compute']} compute, {precision['kv']} KV"
        self.label = f"openvino genai ContinuousBatchingPipeline, {threads} threads; {self.precision_label}"
        self._next_id = 0

    def run_level(self, prompts: list[list[int]], max_tokens: int, concurrency: int,
                  decode=None) -> tuple[list[Result], float]:
        """`closed_loop` over the pipeline: (results in prompt order, wall seconds)."""
        import numpy as np
        import openvino as ov

        config = self._config(max_tokens)

        def submit(ids: list[int]) -> Flight:
            handle = self.pipe.add_request(self._next_id, ov.Tensor(np.array([ids], dtype=np.int64)), config)
            self._next_id += 1
            return Flight(handle, time.perf_counter())

        return closed_loop(prompts, concurrency, submit, self.pipe.step, decode)

    def _config(self, max_tokens: int):
        import openvino_genai

        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample, config.ignore_eos = max_tokens, False, True
        return config


def load_peers(names: list[str], model: str | None, threads: int, cache: str | None = None, log=print) -> list:
    """Peers for `names` on `model` (None: the default model; its GenAI folder exported once into the cache).
    Unknown names are refused; a missing package skips them with one line."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown bench-serve peer(s): {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if not names:
        return []
    try:
        import openvino_genai
        import openvino_tokenizers  # noqa: F401 -- the tokenizer models GenAI's folders carry

        from mirror_rt.exporters.genai import export_genai_folder
    except ImportError as exc:
        log(f"bench-serve: skipping {', '.join(names)}: {exc} (pip install openvino-genai openvino-tokenizers)")
        return []
    folder = export_genai_folder(model, weights="fp32", cache=cache, log=log)
    peers = []
    for name in names:
        properties = {"INFERENCE_NUM_THREADS": threads, **PEERS[name]}
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # GenAI's CB default, and our server has no prefix cache either
        pipe = openvino_genai.ContinuousBatchingPipeline(str(folder), scheduler, "CPU", properties)
        peers.append(ContinuousBatchingPeer(name, pipe, compiled_precision(folder, properties), threads))
    return peers


def compiled_precision(folder, properties: dict) -> dict:
    """The compute precision and KV element types the CPU plugin compiles the pipeline's graph (the folder's model in
    paged-attention form) at with `properties`, read back from the compiled model."""
    import openvino as ov
    from openvino._offline_transformations import paged_attention_transformation

    model = ov.Core().read_model(str(folder / "openvino_model.xml"))
    paged_attention_transformation(model)
    compiled = ov.Core().compile_model(model, "CPU", properties)
    types = {port.get_any_name(): port.get_element_type().get_type_name() for port in compiled.inputs}
    key, value = types.get("key_cache.0", "?"), types.get("value_cache.0", "?")
    compute = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    kv = SHORT.get(key, key) if key == value else f"{SHORT.get(key, key)} key / {SHORT.get(value, value)} value"
    return {"weights": "fp32", "compute": SHORT.get(compute, compute), "kv": kv}


def closed_loop(prompts: list[list[int]], concurrency: int, submit, step,
                decode=None) -> tuple[list[Result], float]:
    """Every prompt through an engine driven by `step()`, at most `concurrency` in flight, the next added as soon as
    one finishes (`submit(ids)` -> its Flight); (results in prompt order, wall seconds). `decode` (ids -> text),
    applied once the clock stopped, fills each result's text: it only says whether the peer wrote what we did."""
    waiting, running, flights = deque(enumerate(prompts)), {}, [None] * len(prompts)
    results = [None] * len(prompts)
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < concurrency:
            index, ids = waiting.popleft()
            running[index] = flights[index] = submit(ids)
        step()
        now = time.perf_counter()
        for index, flight in list(running.items()):
            flight.collect(now)
            if flight.finished():
                results[index] = flight.result(now)
                del running[index]
    wall = time.perf_counter() - start
    if decode:
        for result, flight in zip(results, flights):
            result.text = decode(flight.ids)
    return results, wall
