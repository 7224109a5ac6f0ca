"""Device resolution: a device string (`backend:device[:index]` such as `torch:cuda:1`, `openvino:NPU`, `ort:qnn`, or
a bare `cpu`, `cuda`, `gpu`, `npu`) parsed into a `DeviceSpec`, and `resolve`d to a backend here that runs the bundle's
graph format, else to the fastest CPU backend with a one-line `DeviceFallbackWarning` (`DeviceError` when strict).
`torch_target` / `torch_draft_device` do the same for torch models. It loads nothing.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

SHORT = {"torch": "torch", "openvino": "openvino", "onnxruntime": "ort"}  # a backend as device strings name it
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


def stderr_line(message: str) -> None:
    """The default log of engine assembly: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


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
        return name if self.backend == "auto" else f"{SHORT[self.backend]}:{name}"


def parse_device(text: str) -> DeviceSpec:
    """A device string -> DeviceSpec; `auto` (timed at bundle load, devices.auto_draft) is the CPU elsewhere."""
    if text.strip().lower() == "auto":
        return DeviceSpec("auto", "cpu")
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


class FoundDevices(Mapping):
    """Per backend, the devices this machine has ([] when not installed), each backend asked once, on first lookup
    (importing torch or OpenVINO takes more than a second an ONNX Runtime bundle never needs)."""

    def __init__(self):
        self._found: dict[str, list[str]] = {}

    def __getitem__(self, backend: str) -> list[str]:
        if backend not in self._found:
            self._found[backend] = _PROBES[backend]()  # KeyError: no such backend
        return self._found[backend]

    def __iter__(self):
        return iter(_PROBES)

    def __len__(self) -> int:
        return len(_PROBES)


def _torch_devices() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _openvino_devices() -> list[str]:
    try:
        import openvino as ov
    except ImportError:
        return []
    return list(ov.Core().available_devices)


def _onnxruntime_devices() -> list[str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    from mirror_rt.devices.onnxruntime.backend import PROVIDERS

    names = {v: k for k, v in PROVIDERS.items()}  # providers a bundle can run on (AzureExecutionProvider is not one)
    return [names[p] for p in ort.get_available_providers() if p in names]


_PROBES = {"torch": _torch_devices, "openvino": _openvino_devices, "onnxruntime": _onnxruntime_devices}
available_devices = FoundDevices  # () -> backend -> its devices here


def format_devices(devices: Mapping[str, list[str]] | None = None) -> str:
    """One line per backend, for `mirror-rt devices`."""
    devices = available_devices() if devices is None else devices
    return "\n".join(f"{backend:12s} " + (", ".join(f"{SHORT[backend]}:{d}" for d in names) or "(not installed)")
                     for backend, names in devices.items())


def is_available(spec: DeviceSpec, devices: Mapping[str, list[str]] | None = None) -> bool:
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
    """A concrete spec that exists here and runs `graph_format` ("onnx-shared": an ONNX bundle whose KV lives in shared
    buffers, ONNX Runtime only); else the fallback, whose warning names what each candidate backend missed."""
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


def names_torch_device(target_device: str) -> bool:
    """Whether a bundle-less `--target` asks for torch: `cuda[:N]`, `torch:cpu`, `torch:cuda[:N]`."""
    spec = parse_device(target_device)
    return spec.backend == "torch" or (spec.backend == "auto" and spec.device == "cuda")


def torch_target(target_device: str, strict: bool = False, log=None) -> str | None:
    """The torch device of a bundle-less `--target` naming one (`cuda`, `cuda:1`, `torch:cpu`, `torch:cuda`). One torch
    cannot serve: DeviceError when strict; else `torch:cuda` falls back to the CPU with a warning, and a bare `cuda`
    returns None after a warning line (the default bundle then runs on the CPU)."""
    import torch
    spec = parse_device(target_device)
    count = torch.cuda.device_count()
    if spec.device == "cpu":
        return "cpu"
    if (spec.index or 0) < count:
        return f"cuda:{spec.index or 0}"
    build = "a CPU build of torch" if torch.version.cuda is None else f"torch {torch.__version__}"
    reason = f"device '{target_device}' unusable here: torch sees no CUDA device ({build}, {count} found)"
    if strict:
        raise DeviceError(f"{reason} (strict devices: no fallback)")
    if spec.backend == "torch":
        warnings.warn(f"{reason}; using 'torch:cpu' instead", DeviceFallbackWarning, stacklevel=3)
        return "cpu"
    (log or stderr_line)(f"mirror-rt: warning: {reason}; running the default model's bundle on the CPU")
    return None


def torch_draft_device(draft_device: str, strict: bool) -> str:
    """Torch drafts run on the CPU (torch's int8 kernels are CPU kernels): say so when asked for another device."""
    from mirror_rt.devices.placement import is_accelerator

    if is_accelerator(draft_device):
        reason = (f"draft device '{draft_device}' unusable here: the torch draft (int8 copy or --draft-model) runs "
                  "on the CPU only; give --draft-bundle for a draft on another device")
        if strict:
            raise DeviceError(f"{reason} (strict devices: no fallback)")
        warnings.warn(f"{reason}; using 'torch:cpu' instead", DeviceFallbackWarning, stacklevel=3)
    return "torch:cpu"
