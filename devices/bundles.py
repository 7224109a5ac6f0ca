"""Loading one role of a bundle (`load_model`) on a resolved device, from the worker's own thread so the backend's
thread pools inherit its pin (`WorkerBudget`). Backends are imported only when a graph loads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from mirror_rt.devices.registry import DeviceSpec, resolve
from mirror_rt.models.config import ModelConfig
from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.transfer import set_threads


@dataclass(frozen=True)
class WorkerBudget:
    """The compute share of one worker. `apply()` runs in the worker's own thread before it loads: Linux pins only the
    calling thread, and the pools a backend creates afterwards inherit its mask (torch's pool is process-wide: two
    torch workers share the last `threads` applied)."""

    threads: int | None = None  # compute threads of this worker's backend (None: backend default)
    cpus: tuple[int, ...] | None = None  # cores this worker's thread and its pools may use
    precision: str | None = None  # OpenVINO CPU inference precision (None: exact f32; "bf16" for drafts)
    # every core, where this worker may take the other's too: a split target's prompt (Mirror's draft idles until it
    # adopts the prompt's KV), and both roles' calls in steps spread over every core (runtime.batch.verify); ONNX
    # Runtime runs them through second sessions (a second copy of the weights), others pipeline the target's prompt
    wide_cpus: tuple[int, ...] | None = None

    def apply(self) -> None:
        """Pin the calling thread to `cpus` (Linux) and set torch's threads where torch is imported."""
        pin(self.cpus)
        if self.threads:
            set_threads(self.threads)


# address space a loaded bundle takes beyond its graphs and the weights they map: thread stacks, allocator arenas,
# the tokenizer, ONNX Runtime's buffers (measured: docs/models.md, "Address space")
SESSION_HEADROOM = 1 << 30  # the 7B in ar: 0.81 GiB beyond its 9.13 GiB of mapped weights
GRAPH_READ_WHOLE = 64 << 20  # a graph file this large holds its weights inline: not parsed, counted twice (read, and
# prepacked by ONNX Runtime's CPU kernels)


def check_address_space(graphs: list[Path], what: str) -> None:
    """OutOfMemory in one line when an address-space limit leaves less than loading `graphs` maps (each session maps
    the weights its graph names in weights.bin) plus SESSION_HEADROOM. Without this check ONNX Runtime failed
    mid-load with std::bad_alloc, or the tokenizer's Rust code aborted the process (exit 134)."""
    from mirror_rt.models.memory import OutOfMemory, address_space_left, gigabytes

    left = address_space_left()
    if left is None:
        return
    mapped = sum(graph_bytes(path) for path in graphs)
    need = mapped + SESSION_HEADROOM
    if need > left:
        raise OutOfMemory(f"out of memory: {what} needs about {gigabytes(need)} more address space "
                          f"({gigabytes(mapped)} of graphs and weights its {len(graphs)} sessions map, "
                          f"{gigabytes(SESSION_HEADROOM)} for threads and buffers), the address-space limit "
                          f"(ulimit -v) leaves {gigabytes(left)}: raise it by {gigabytes(need - left)} or more")


def graph_bytes(path: Path) -> int:
    """The address space a session of the graph at `path` takes for it: the file and the external weights it names
    (mapped where they lie), or twice a file of inline weights (read, then prepacked)."""
    size = path.stat().st_size
    if path.suffix != ".onnx":  # OpenVINO IR: its weights in the .bin beside it
        weights = path.with_suffix(".bin")
        return size + (weights.stat().st_size if weights.is_file() else 0)
    if size > GRAPH_READ_WHOLE:
        return 2 * size
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    external = 0
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {entry.key: entry.value for entry in tensor.external_data}
            external += int(entries.get("length", 0))
    return size + external


def role_graphs(folder: Path, manifest, role: str) -> list[Path]:
    """The graph files of `role` ("target": prefix, exit and suffix; "draft")."""
    roles = ("draft",) if role == "draft" else ("target_prefix", "target_exit", "target_suffix")
    return [Path(folder) / manifest.graph(r).file for r in roles]


def load_model(folder: Path, manifest, role: str, device: str | DeviceSpec, strict: bool = False,
               budget: WorkerBudget = WorkerBudget()):
    """Load the `role` ("target": prefix, exit and suffix graphs; "draft") of a read manifest, from the worker's
    thread."""
    spec = resolve(device, strict, bundle_format(manifest, role))
    budget.apply()
    config = ModelConfig.from_dict(manifest.draft_config if role == "draft" else manifest.target_config)
    paths = role_graphs(folder, manifest, role)
    loader = {"openvino": _load_openvino, "onnxruntime": _load_onnxruntime, "torch": _load_torch}[spec.backend]
    return loader(paths, manifest, config, spec, budget)


def bundle_format(manifest, role: str) -> str:
    """The graph format a backend must run for `role`: "onnx-shared" for ONNX graphs over shared KV buffers."""
    graph_format = manifest.graph("draft" if role == "draft" else "target_prefix").format
    return "onnx-shared" if graph_format == "onnx" and manifest.kv_layout.get("shared") else graph_format


def draft_copies_target(target_manifest, draft_manifest) -> bool:
    """Whether the draft of `draft_manifest` is the target of `target_manifest` at another precision (same config and
    tokenizer), so it may start from the target's KV (Capabilities.reads_target_rows)."""
    if not draft_manifest.draft_of_target:
        return False
    return draft_manifest is target_manifest or (
        draft_manifest.target_config == target_manifest.target_config
        and draft_manifest.tokenizer.get("sha256") == target_manifest.tokenizer.get("sha256"))


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
    more_cores = len(budget.wide_cpus or ()) > (budget.threads or 0)
    wide = budget.wide_cpus if spec.device == "cpu" and more_cores else None
    if len(paths) == 1:  # a draft: its wide session (spread steps) where a second copy fits
        if spec.device == "cpu" and manifest.graph("draft").precision == "q4_1":
            from mirror_rt.devices.onnxruntime.session import gguf_draft

            paths = [gguf_draft(Path(paths[0]))]
        wide = wide if wide and _second_copy_fits(paths, loading=paths) else None
        wide_graph = in_background(_wide_graphs, paths, kv_shape, wide) if wide else lambda: [None]
        graph = ORTGraph(paths[0], spec.device, kv_shape, budget.threads)
        return ORTModel(graph, config.vocab_size, manifest.max_context, wide_graph()[0])
    if wide and not _second_copy_fits([paths[0], paths[2]], loading=paths):
        wide = None  # the prompt then runs pipelined over the two cores (ORTSplitTarget.prefill_pipelined)
    # the prompt's sessions load in their own thread, on the cores the worker's own sessions leave free
    prompt_graphs = in_background(_wide_graphs, [paths[0], paths[2]], kv_shape, wide) if wide else lambda: None
    graphs = [ORTGraph(p, spec.device, kv_shape, budget.threads) for p in paths]
    return ORTSplitTarget(*graphs, config.vocab_size, manifest.max_context, manifest.kappa, prompt_graphs())


def _second_copy_fits(paths, share: float = 0.25, loading=()) -> bool:
    """Whether a second copy of these graphs' weights takes at most `share` of the memory available once the graphs
    `loading` are loaded (no /proc/meminfo: no), and fits the address space a limit leaves beside them (its sessions
    map weights.bin again: the 7B's mirror mode maps it three times)."""
    from mirror_rt.models.memory import address_space_left

    left = address_space_left()
    # twice: the draft loads beside the target meanwhile (a self-draft maps as much again)
    if left is not None and 2 * sum(graph_bytes(Path(p)) for p in (*paths, *loading)) + SESSION_HEADROOM > left:
        return False
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    available -= sum(Path(p).stat().st_size for p in loading)
    return sum(Path(p).stat().st_size for p in paths) <= share * available


def _wide_graphs(paths, kv_shape, cpus: tuple[int, ...]) -> list:
    """CPU sessions with a thread per core of `cpus`, created while the calling thread runs on all of them (their pools
    inherit that mask); the caller's pin is then restored."""
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
    """Start `work(*args)` in a thread (it inherits the caller's pin); returns a function that waits for its result."""
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
