"""Device strings, what this machine has, and loading a bundle's graphs onto devices.

A device string is `backend:device[:index]` (`torch:cuda:1`, `openvino:NPU`, `ort:qnn`) or a
bare device (`cpu`, `cuda`, `gpu`, `npu`), parsed once into a `DeviceSpec`. `resolve` maps
it to a backend that can run the bundle's graph format and exists here; otherwise it falls
back to the fastest CPU backend with a one-line `DeviceFallbackWarning`, or raises
`DeviceError` when strict. Backends are imported lazily, only when a graph is loaded.
Fastest CPU order (measured on the default model, 1 thread): onnxruntime, openvino, torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from mirror_rt.runtime.affinity import pin, restore

BACKEND_ALIASES = {"torch": "torch", "pt": "torch", "openvino": "openvino", "ov": "openvino",
                   "ort": "onnxruntime", "onnxruntime": "onnxruntime"}
# Bare device names -> backends that may serve them, best first.
GENERIC = {"cpu": ("onnxruntime", "openvino", "torch"), "cuda": ("torch", "onnxruntime"),
           "gpu": ("openvino",), "npu": ("openvino",), "qnn": ("onnxruntime",)}
FORMAT_BACKENDS = {"openvino": ("openvino",), "onnx": ("onnxruntime", "openvino"), "onnx-shared": ("onnxruntime",),
                   "torch": ("torch",)}
CPU_ORDER = GENERIC["cpu"]  # fastest first
# ONNX Runtime's CUDA provider would run our fp32 graphs with attention (GroupQueryAttention: fp16/bf16 only on
# CUDA) falling back to the CPU layer by layer and KV buffers bound in host memory: refused, torch serves CUDA.
ORT_CUDA_REFUSAL = ("ONNX Runtime on CUDA is not supported (fp32 graphs: attention would fall back to the CPU); "
                    "run the target in torch: --target cuda without --bundle, or a --format torch bundle")


class DeviceError(ValueError):
    """A device string that cannot be parsed, or (strict) a device that cannot be used here."""


class DeviceFallbackWarning(UserWarning):
    """The requested device is unusable here; a CPU backend is used instead."""


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string."""

    backend: str  # "torch" | "openvino" | "onnxruntime" | "auto" (bare device name)
    device: str  # torch: cpu|cuda; openvino: CPU|GPU|NPU|GPU.1; onnxruntime: cpu|cuda|qnn|openvino|...
    index: int | None = None  # torch cuda device index

    def __str__(self) -> str:
        name = self.device if self.index is None else f"{self.device}:{self.index}"
        return name if self.backend == "auto" else f"{'ort' if self.backend == 'onnxruntime' else self.backend}:{name}"


def parse_device(text: str) -> DeviceSpec:
    """`cpu`, `cuda:1`, `npu`, `openvino:NPU`, `ort:qnn`, `torch:cuda:0`, ... -> DeviceSpec."""
    parts = text.strip().split(":")
    head = parts[0].lower()
    if head in BACKEND_ALIASES:  # backend:device[:index]; a bare backend name means its CPU
        backend, rest = BACKEND_ALIASES[head], parts[1:] or ["cpu"]
    else:
        backend, rest = "auto", parts
    if not rest[0] or len(rest) > 2 or (backend == "auto" and rest[0].lower() not in GENERIC):
        raise DeviceError(f"unknown device '{text}' (expected cpu, cuda[:N], gpu, npu, or "
                          "backend:device such as torch:cuda:0, openvino:NPU, ort:qnn)")
    index = None
    if len(rest) == 2:
        if not rest[1].isdigit():
            raise DeviceError(f"unknown device '{text}': index '{rest[1]}' is not a number")
        index = int(rest[1])
    device = rest[0].upper() if backend == "openvino" else rest[0].lower()
    return DeviceSpec(backend, device, index)


def available_devices() -> dict[str, list[str]]:
    """Per backend, the devices this machine has ([] when the backend is not installed)."""
    found: dict[str, list[str]] = {}
    try:
        import torch

        found["torch"] = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except ImportError:
        found["torch"] = []
    try:
        import openvino as ov

        found["openvino"] = list(ov.Core().available_devices)
    except ImportError:
        found["openvino"] = []
    try:
        import onnxruntime as ort
        from mirror_rt.devices.onnxruntime_backend import PROVIDERS

        names = {v: k for k, v in PROVIDERS.items()}
        found["onnxruntime"] = [names.get(p, p) for p in ort.get_available_providers()]
    except ImportError:
        found["onnxruntime"] = []
    return found


def format_devices(devices: dict[str, list[str]] | None = None) -> str:
    """One line per backend, for `mirror-rt devices`."""
    devices = available_devices() if devices is None else devices
    prefix = {"torch": "torch", "openvino": "openvino", "onnxruntime": "ort"}
    return "\n".join(f"{backend:12s} " + (", ".join(f"{prefix[backend]}:{d}" for d in names) or "(not installed)")
                     for backend, names in devices.items())


def is_available(spec: DeviceSpec, devices: dict[str, list[str]] | None = None) -> bool:
    """Whether a concrete (non-auto) spec exists on this machine."""
    devices = available_devices() if devices is None else devices
    have = devices.get(spec.backend, [])
    if spec.backend == "torch":
        return spec.device == "cpu" or f"cuda:{spec.index or 0}" in have
    if spec.backend == "openvino":
        return any(d == spec.device or d.startswith(spec.device + ".") for d in have)
    return spec.device in have


def _concrete(spec: DeviceSpec, backend: str) -> DeviceSpec:
    if spec.backend != "auto":
        return spec
    if backend == "openvino":
        return DeviceSpec(backend, spec.device.upper() + ("" if spec.index is None else f".{spec.index}"))
    return DeviceSpec(backend, spec.device, spec.index)


def fastest_cpu(graph_format: str | None = None, devices: dict | None = None) -> DeviceSpec:
    """The first installed CPU backend (CPU_ORDER) that runs `graph_format`."""
    devices = available_devices() if devices is None else devices
    for backend in CPU_ORDER:
        spec = _concrete(DeviceSpec("auto", "cpu"), backend)
        if (graph_format is None or backend in FORMAT_BACKENDS[graph_format]) and is_available(spec, devices):
            return spec
    raise DeviceError(f"no installed backend runs {graph_format} graphs on the CPU")


def resolve(spec: DeviceSpec | str, strict: bool = False, graph_format: str | None = None,
            devices: dict | None = None) -> DeviceSpec:
    """A concrete spec that exists here and runs `graph_format`; else fallback (or DeviceError).

    `graph_format` "onnx-shared" is an ONNX bundle whose KV lives in shared buffers (ONNX Runtime only).
    The warning names, per candidate backend, what was missing (never that a present device is absent).
    """
    spec = parse_device(spec) if isinstance(spec, str) else spec
    if spec.backend == "onnxruntime" and spec.device == "cuda":
        raise DeviceError(f"device '{spec}': {ORT_CUDA_REFUSAL}")
    devices = available_devices() if devices is None else devices
    backends = GENERIC[spec.device] if spec.backend == "auto" else (spec.backend,)
    reasons = []
    for backend in backends:
        candidate = _concrete(spec, backend)
        reason = _unusable(candidate, graph_format, devices)
        if reason is None:
            return candidate
        reasons.append(reason)
    reason = "; ".join(reasons)
    if strict:
        raise DeviceError(f"device '{spec}' unusable here: {reason} (strict devices: no fallback)")
    fallback = fastest_cpu(graph_format, devices)
    warnings.warn(f"device '{spec}' unusable here: {reason}; using '{fallback}' instead", DeviceFallbackWarning,
                  stacklevel=2)
    return fallback


def resolve_noted(device: DeviceSpec | str, strict: bool = False, graph_format: str | None = None):
    """`resolve`, also saying whether it fell back: (spec, fell back); the warning is shown as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeviceFallbackWarning)
        spec = resolve(device, strict, graph_format)
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=3)
    return spec, any(w.category is DeviceFallbackWarning for w in caught)


def _unusable(spec: DeviceSpec, graph_format: str | None, devices: dict) -> str | None:
    """Why `spec` cannot run `graph_format` here, in a few words; None when it can."""
    plain = "onnx" if graph_format == "onnx-shared" else graph_format
    if plain and spec.backend not in FORMAT_BACKENDS[plain]:
        return f"{spec.backend} cannot run {plain} graphs"
    if spec.backend == "onnxruntime" and spec.device == "cuda":
        return ORT_CUDA_REFUSAL
    if not is_available(spec, devices):
        return _missing(spec, devices)
    if graph_format == "onnx-shared" and spec.backend != "onnxruntime":
        return (f"this bundle keeps its KV in shared buffers (--kv shared), which only ONNX Runtime runs, not {spec} "
                "(export for OpenVINO: --format openvino, plus --static for NPUs, or --kv explicit)")
    return None


def _missing(spec: DeviceSpec, devices: dict) -> str:
    """What is missing for `spec` (a backend, a provider, a device)."""
    if not devices.get(spec.backend):
        return f"{spec.backend} is not installed"
    if spec.backend == "torch":
        return f"torch sees no CUDA device{'' if spec.index is None else f' {spec.index}'}"
    if spec.backend == "onnxruntime":
        return f"onnxruntime has no {spec.device.upper()} provider (it has {', '.join(devices[spec.backend])})"
    return f"OpenVINO sees no {spec.device} device (it sees {', '.join(devices[spec.backend])})"


@dataclass(frozen=True)
class Placement:
    """Where a loaded model runs: what was asked for and what it got (`LoadedModel.placement`)."""

    requested: str  # the device string given ("cuda", "npu", "cpu", "ort:cpu"...)
    actual: str  # the backend:device it runs on
    fell_back: bool  # the requested device was unusable here (a DeviceFallbackWarning was shown)


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
        """Pin the calling thread to `cpus` (Linux; ignored elsewhere) and set torch's threads."""
        pin(self.cpus)
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


def load_model(folder: Path, manifest, role: str, device: str | DeviceSpec, strict: bool = False,
               budget: WorkerBudget = WorkerBudget()):
    """Load the `role` ("target" or "draft") of a read manifest; call from the worker's thread.

    The target's exit graph runs on the target's device under the target's budget.
    """
    spec, fell_back = resolve_noted(device, strict, bundle_format(manifest, role))
    budget.apply()
    config = _config(manifest, role)
    roles = ("draft",) if role == "draft" else ("target_prefix", "target_exit", "target_suffix")
    entries = [manifest.graph(r) for r in roles]
    paths = [Path(folder) / e.file for e in entries]
    loader = {"openvino": _load_openvino, "onnxruntime": _load_onnxruntime, "torch": _load_torch}[spec.backend]
    model = loader(paths, manifest, config, spec, budget)
    model.placement = Placement(str(device), str(spec), fell_back)
    return model


def bundle_format(manifest, role: str) -> str:
    """The graph format a backend must run for `role`: "onnx-shared" for ONNX graphs over shared KV buffers."""
    graph_format = manifest.graph("draft" if role == "draft" else "target_prefix").format
    return "onnx-shared" if graph_format == "onnx" and manifest.kv_layout.get("shared") else graph_format


def draft_copies_target(target_manifest, draft_manifest) -> bool:
    """Whether the draft of `draft_manifest` is the target of `target_manifest` at another precision.

    Such a draft may start from the target's prompt KV (runtime.mirror). A draft taken from another
    bundle qualifies only if that bundle's target has the same config and tokenizer.
    """
    if not draft_manifest.draft_of_target:
        return False
    return draft_manifest is target_manifest or (
        draft_manifest.target_config == target_manifest.target_config
        and draft_manifest.tokenizer.get("sha256") == target_manifest.tokenizer.get("sha256"))


def adopts_from(draft, target) -> bool:
    """Whether `draft.adopt` can take `target`'s caches (same backend and KV layout; see LoadedModel.adopt)."""
    can_adopt = getattr(draft, "can_adopt", None)
    return bool(can_adopt and can_adopt(target))


def _config(manifest, role: str):
    from mirror_rt.models.config import ModelConfig

    return ModelConfig.from_dict(manifest.draft_config if role == "draft" else manifest.target_config)


def _load_openvino(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    from mirror_rt.devices.openvino_backend import (
        STREAM_LOGITS,
        OVGraph,
        OVModel,
        OVSplitTarget,
        OVStreamDraft,
    )

    window = manifest.max_window if manifest.static else 0
    graphs = [OVGraph(p, spec.device, (config.n_kv_heads, config.head_dim), budget.threads, window,
                      pinned=bool(budget.cpus), precision=budget.precision) for p in paths]
    if len(graphs) == 1:
        streams = STREAM_LOGITS in graphs[0].output_names  # an explicit-KV SS draft (exporters.ss_graph)
        return (OVStreamDraft if streams else OVModel)(graphs[0], config.vocab_size, manifest.max_context)
    return OVSplitTarget(*graphs, config.vocab_size, manifest.max_context, manifest.kappa)


def _load_onnxruntime(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    from mirror_rt.devices.onnxruntime_backend import (
        STREAM_LOGITS,
        ORTGraph,
        ORTModel,
        ORTSplitTarget,
        ORTStreamDraft,
    )

    kv_shape = (config.n_kv_heads, config.head_dim)
    graphs = [ORTGraph(p, spec.device, kv_shape, budget.threads) for p in paths]
    if len(graphs) == 1:
        streams = STREAM_LOGITS in graphs[0].output_names  # an SS draft (exporters.ss_graph)
        return (ORTStreamDraft if streams else ORTModel)(graphs[0], config.vocab_size, manifest.max_context)
    more_cores = len(budget.prompt_cpus or ()) > (budget.threads or 0)
    wide = budget.prompt_cpus if spec.device == "cpu" and more_cores else None
    if wide and not _second_copy_fits([paths[0], paths[2]]):
        wide = None  # the prompt then runs pipelined over the two cores (ORTSplitTarget.prefill_pipelined)
    prompt_graphs = _wide_graphs([paths[0], paths[2]], kv_shape, wide) if wide else None
    return ORTSplitTarget(*graphs, config.vocab_size, manifest.max_context, manifest.kappa, prompt_graphs)


def _second_copy_fits(paths, share: float = 0.25) -> bool:
    """Whether a second copy of these graphs' weights takes at most `share` of the memory available now.

    Unknown (no /proc/meminfo): no. The default model's target needs about 0.7 GB more.
    """
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    return sum(Path(p).stat().st_size for p in paths) <= share * available


def _wide_graphs(paths, kv_shape, cpus: tuple[int, ...]) -> list:
    """CPU sessions with one thread per core of `cpus`: the pool threads are created while the calling
    thread may run on all of them (they inherit that mask), then the caller's own pin is restored."""
    from mirror_rt.devices.onnxruntime_backend import ORTGraph

    previous = pin(cpus)
    try:
        return [ORTGraph(p, "cpu", kv_shape, len(cpus)) for p in paths]
    finally:
        restore(previous)


def _load_torch(paths, manifest, config, spec: DeviceSpec, budget: WorkerBudget):
    """Rebuild the Transformer from the manifest's config and the bundle's safetensors."""
    import dataclasses

    from mirror_rt.devices.torch_backend import TorchModel
    from mirror_rt.devices.torch_split import TorchSplitTarget
    from mirror_rt.models.transformer import Transformer
    from safetensors.torch import load_file

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


def load_tokenizer(folder: Path, manifest):
    """The bundle's tokenizer: the copied Hugging Face files, or the byte tokenizer of presets."""
    from mirror_rt.models.tokenizer import ByteTokenizer, HFTokenizer

    if manifest.tokenizer.get("kind") == "bytes":
        return ByteTokenizer(manifest.tokenizer["vocab_size"])
    return HFTokenizer(Path(folder))
