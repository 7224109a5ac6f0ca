"""Loading a bundle: its graphs onto resolved devices, each worker within its compute share.

`load_model` loads one role ("target": prefix, exit and suffix graphs; "draft") of a read manifest
on a device (`devices.registry.resolve` picks the backend), from the worker's own thread so the
backend's thread pools inherit the worker's pin (`WorkerBudget`). Backends are imported lazily,
only when a graph is loaded. The engine over a whole bundle is `devices.bundle_engine.load_bundle`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from mirror_rt.devices.registry import DeviceSpec, resolve
from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.transfer import set_threads


@dataclass(frozen=True)
class WorkerBudget:
    """The compute share of one worker (target or draft).

    `apply()` must run in the worker's own thread before it loads its model: on Linux
    `os.sched_setaffinity(0, cpus)` pins only the calling thread, and the thread pools a
    backend creates afterwards (ONNX Runtime's intra-op pool at session creation,
    OpenVINO's CPU streams at compile time) inherit that mask. torch's intra-op pool is
    process-wide, so two torch workers share one `threads` setting (the last applied).
    """

    threads: int | None = None  # compute threads of this worker's backend (None: backend default)
    cpus: tuple[int, ...] | None = None  # cores this worker's thread and its pools may use
    precision: str | None = None  # OpenVINO CPU inference precision (None: exact f32; "bf16" for drafts)
    # Cores a split target's prompt pass may use (Mirror: the draft's core idles until it adopts the
    # prompt's KV). ONNX Runtime: a second prefix/suffix session pair, one thread per core (a second
    # copy of the target's weights in memory); other backends pipeline the prompt instead.
    prompt_cpus: tuple[int, ...] | None = None

    def apply(self) -> None:
        """Pin the calling thread to `cpus` (Linux; ignored elsewhere) and set torch's threads (when torch is
        imported: an ONNX Runtime or OpenVINO worker may never import it, runtime.transfer)."""
        pin(self.cpus)
        if self.threads:
            set_threads(self.threads)


def load_model(folder: Path, manifest, role: str, device: str | DeviceSpec, strict: bool = False,
               budget: WorkerBudget = WorkerBudget()):
    """Load the `role` ("target" or "draft") of a read manifest; call from the worker's thread.

    The target's exit graph runs on the target's device under the target's budget.
    """
    spec = resolve(device, strict, bundle_format(manifest, role))
    budget.apply()
    config = _config(manifest, role)
    roles = ("draft",) if role == "draft" else ("target_prefix", "target_exit", "target_suffix")
    entries = [manifest.graph(r) for r in roles]
    paths = [Path(folder) / e.file for e in entries]
    loader = {"openvino": _load_openvino, "onnxruntime": _load_onnxruntime, "torch": _load_torch}[spec.backend]
    return loader(paths, manifest, config, spec, budget)


def bundle_format(manifest, role: str) -> str:
    """The graph format a backend must run for `role`: "onnx-shared" for ONNX graphs over shared KV buffers."""
    graph_format = manifest.graph("draft" if role == "draft" else "target_prefix").format
    return "onnx-shared" if graph_format == "onnx" and manifest.kv_layout.get("shared") else graph_format


def draft_copies_target(target_manifest, draft_manifest) -> bool:
    """Whether the draft of `draft_manifest` is the target of `target_manifest` at another precision.

    Such a draft may start from the target's KV (runtime.backend.Capabilities.reads_target_rows). A draft taken
    from another bundle qualifies only if that bundle's target has the same config and tokenizer.
    """
    if not draft_manifest.draft_of_target:
        return False
    return draft_manifest is target_manifest or (
        draft_manifest.target_config == target_manifest.target_config
        and draft_manifest.tokenizer.get("sha256") == target_manifest.tokenizer.get("sha256"))


def _config(manifest, role: str):
    from mirror_rt.models.config import ModelConfig

    return ModelConfig.from_dict(manifest.draft_config if role == "draft" else manifest.target_config)


def _load_openvino(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    from mirror_rt.devices.openvino.backend import OVGraph, OVModel, OVSplitTarget

    window = manifest.max_window if manifest.static else 0
    graphs = [OVGraph(p, spec.device, (config.n_kv_heads, config.head_dim), budget.threads, window,
                      pinned=bool(budget.cpus), precision=budget.precision) for p in paths]
    if len(graphs) == 1:
        return OVModel(graphs[0], config.vocab_size, manifest.max_context)
    return OVSplitTarget(*graphs, config.vocab_size, manifest.max_context, manifest.kappa)


def _load_onnxruntime(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    from mirror_rt.devices.onnxruntime.backend import ORTGraph, ORTModel, ORTSplitTarget

    kv_shape = (config.n_kv_heads, config.head_dim)
    if len(paths) == 1:
        graph = ORTGraph(paths[0], spec.device, kv_shape, budget.threads)
        return ORTModel(graph, config.vocab_size, manifest.max_context)
    more_cores = len(budget.prompt_cpus or ()) > (budget.threads or 0)
    wide = budget.prompt_cpus if spec.device == "cpu" and more_cores else None
    if wide and not _second_copy_fits([paths[0], paths[2]], loading=paths):
        wide = None  # the prompt then runs pipelined over the two cores (ORTSplitTarget.prefill_pipelined)
    # the prompt's sessions load in their own thread, on the cores the worker's own sessions leave free
    prompt_graphs = in_background(_wide_graphs, [paths[0], paths[2]], kv_shape, wide) if wide else lambda: None
    graphs = [ORTGraph(p, spec.device, kv_shape, budget.threads) for p in paths]
    return ORTSplitTarget(*graphs, config.vocab_size, manifest.max_context, manifest.kappa, prompt_graphs())


def _second_copy_fits(paths, share: float = 0.25, loading=()) -> bool:
    """Whether a second copy of these graphs' weights takes at most `share` of the memory available once the
    graphs `loading` (not loaded yet) are.

    Unknown (no /proc/meminfo): no. The default model's target needs about 0.7 GB more.
    """
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    available -= sum(Path(p).stat().st_size for p in loading)
    return sum(Path(p).stat().st_size for p in paths) <= share * available


def _wide_graphs(paths, kv_shape, cpus: tuple[int, ...]) -> list:
    """CPU sessions with one thread per core of `cpus`: the pool threads are created while the calling
    thread may run on all of them (they inherit that mask), then the caller's own pin is restored."""
    from mirror_rt.devices.onnxruntime.backend import ORTGraph

    previous = pin(cpus)
    try:
        return [ORTGraph(p, "cpu", kv_shape, len(cpus)) for p in paths]
    finally:
        restore(previous)


def _load_torch(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    """Rebuild the Transformer from the manifest's config and the bundle's safetensors."""
    import dataclasses

    from safetensors.torch import load_file

    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.devices.torch.split import TorchSplitTarget
    from mirror_rt.models.transformer import Transformer

    config = dataclasses.replace(config, max_seq_len=min(config.max_seq_len, manifest.max_context))
    state = load_file(str(paths[0]))
    model = Transformer(config).to(next(iter(state.values())).dtype)
    missing = model.load_state_dict(state, strict=False).missing_keys
    if [k for k in missing if not (k == "lm_head.weight" and config.tie_embeddings)]:
        from mirror_rt.exporters.manifest import BundleError

        raise BundleError(f"{paths[0]}: weights do not match the manifest's model config")
    device = "cpu" if spec.device == "cpu" else f"cuda:{spec.index or 0}"
    if len(paths) == 1:
        return TorchModel(model, device)
    adapter = None
    if manifest.exit_adapter:  # torch bundles carry the adapter file beside the weights
        from mirror_rt.models.exit_adapter import load_exit_adapter

        adapter = load_exit_adapter(Path(paths[0]).parent / manifest.exit_adapter["file"], model, manifest.exit_layer)
    return TorchSplitTarget(model, manifest.exit_layer, manifest.kappa, device, exit_adapter=adapter)


def in_background(work, *args):
    """Start `work(*args)` in a thread of its own (it inherits the caller's pin); returns a function that waits
    for its result, raising its exception if it failed."""
    result = {}

    def run():
        try:
            result["value"] = work(*args)
        except BaseException as exc:  # re-raised by the waiting thread
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"load-{getattr(work, '__name__', 'work').strip('_')}")
    thread.start()

    def wait():
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return wait


def load_tokenizer(folder: Path, manifest):
    """The bundle's tokenizer: the copied Hugging Face files, or the byte tokenizer of presets."""
    from mirror_rt.models.tokenizer import ByteTokenizer, HFTokenizer

    if manifest.tokenizer.get("kind") == "bytes":
        return ByteTokenizer(manifest.tokenizer["vocab_size"])
    return HFTokenizer(Path(folder))
