"""What an engine is assembled from (`EngineConfig`): one frozen dataclass per concern, each field named as its flag.

Sources, devices, precision, the split (models.config.SplitConfig) and the batch (runtime.batch.decoder.BatchConfig).
Each default is written once; `EngineConfig.from_flags` is the one place flag-named values become these objects.
Torch-only settings are None when not given: giving any, even at its default, asks for torch eager. Decoding settings
are the request's (runtime.config.GenerationConfig).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace

from mirror_rt.models.config import SplitConfig
from mirror_rt.runtime.batch.decoder import BatchConfig
from mirror_rt.runtime.values import is_integer

BUNDLE_WEIGHTS = ("fp32", "int8", "int4", "q4_1", "w8a8")  # --weights: the ONNX export's (exporters.onnx.WEIGHTS)
DRAFT_PRECISIONS = ("f32", "bf16")  # --draft-precision: OpenVINO's CPU compute precision of a draft
TORCH_DEVICE = re.compile(r"(cpu|cuda(:\d+)?)")  # --device: where torch runs the target (--target names the rest)
DTYPES = ("float32", "bfloat16", "float16", "float64", "fp32", "bf16", "fp16", "fp64")  # --dtype
# The options only the torch engine understands: any of them given asks for torch eager.
TORCH_OPTIONS = ("model", "draft_model", "device", "dtype", "threads", "exit_layer", "kappa", "draft_streams",
                 "compile")


@dataclass(frozen=True)
class SourceConfig:
    """What runs: an exported bundle, or a model in torch eager."""

    bundle: str | None = None  # an exported bundle; None: the default model's cached bundle unless torch is asked
    draft_bundle: str | None = None  # take the draft from this bundle (same vocabulary)
    model: str | None = None  # torch target: HF folder, .gguf file or preset; None: the default model
    draft_model: str | None = None  # torch draft: int8 (an int8 copy of the target), target (oracle), or a model
    draft_streams: str | None = None  # trained SS streams (mirror-rt train-draft --out) over the torch draft
    torch: bool = False  # torch eager even when no torch-only option is given
    cache_dir: str | None = None  # model cache (None: $MIRROR_RT_CACHE or ~/.cache/mirror-rt)

    def __post_init__(self):
        for name in ("bundle", "draft_bundle", "model", "draft_model", "draft_streams", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (str, os.PathLike)) and str(value).strip()):
                raise ValueError(f"{name} must be a path or a name, got {value!r}")
        _flag(self, "torch")


@dataclass(frozen=True)
class DeviceConfig:
    """Where it runs: each role's device and the compute threads."""

    target: str = "cpu"  # the target's device: cpu, cuda[:N], gpu, npu, openvino:CPU, ort:qnn, torch:cpu, ...
    draft: str = "auto"  # the draft's device (same forms), or auto: timed and picked at load (devices.auto_draft)
    strict_devices: bool = False  # fail instead of falling back to a CPU backend
    device: str | None = None  # torch: the target's torch device (cpu, cuda, cuda:1; as --target)
    threads: int | None = None  # torch: intra-op threads; a bundle: each worker's threads, unpinned
    pin: bool = True  # torch, mirror: pin target and draft to a core each (2+ cores)

    def __post_init__(self):
        for name in ("target", "draft"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a device name, got {getattr(self, name)!r}")
        if self.threads is not None and not (is_integer(self.threads) and self.threads >= 1):
            raise ValueError(f"threads must be a whole number >= 1, got {self.threads!r}")
        if self.device is not None and not (isinstance(self.device, str) and TORCH_DEVICE.fullmatch(self.device)):
            raise ValueError(f"device must be torch's device for the target: cpu, cuda or cuda:N, got {self.device!r} "
                             "(--target names the other devices: npu, gpu, openvino:CPU, ort:qnn, ...)")
        _flag(self, "strict_devices")
        _flag(self, "pin")


@dataclass(frozen=True)
class PrecisionConfig:
    """At what precision the models compute."""

    weights: str | None = None  # the default model's bundle target precision (BUNDLE_WEIGHTS; None: DEFAULT_WEIGHTS)
    dtype: str | None = None  # torch target dtype; None: bf16 on CUDA (fp16 without bf16), else fp32
    draft_precision: str | None = None  # OpenVINO draft compute precision (f32 | bf16); None: exact f32
    compile: bool | None = None  # torch: static-shape windows under torch.compile

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.draft_precision is not None and self.draft_precision not in DRAFT_PRECISIONS:
            raise ValueError(f"draft_precision must be one of {', '.join(DRAFT_PRECISIONS)}, "
                             f"got {self.draft_precision!r}")
        if self.compile is not None:
            _flag(self, "compile")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is assembled from."""

    models: SourceConfig = field(default_factory=SourceConfig)
    devices: DeviceConfig = field(default_factory=DeviceConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)  # sequences decoded at once, KV memory

    @classmethod
    def from_flags(cls, **flags) -> EngineConfig:
        """The options from flat flag-named values (`bundle=`, `target=`, `kappa=`...); None: not given."""
        return cls().with_flags(**{name: value for name, value in flags.items() if value is not None})

    def torch_asked(self) -> list[str]:
        """The torch-only options given (TORCH_OPTIONS order)."""
        values = {name: value for part in _PARTS for name, value in vars(getattr(self, part)).items()}
        return [name for name in TORCH_OPTIONS if values[name] is not None]

    def with_flags(self, **flags) -> EngineConfig:
        """A copy with some flag-named values replaced (a None value un-gives an option)."""
        unknown = set(flags) - set(flag_names())
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        changed = {}
        for part, kind in _PARTS.items():
            mine = {f.name: flags[f.name] for f in fields(kind) if f.name in flags}
            if mine:
                changed[part] = replace(getattr(self, part), **mine)
        return replace(self, **changed)


def _flag(options, name: str) -> None:
    if not isinstance(getattr(options, name), bool):
        raise ValueError(f"{name} must be true or false, got {getattr(options, name)!r}")


_PARTS = {"models": SourceConfig, "devices": DeviceConfig, "precision": PrecisionConfig, "split": SplitConfig,
          "batch": BatchConfig}


def flag_names() -> list[str]:
    """Every engine option by its flag's name (`--draft-model` is `draft_model`)."""
    return [f.name for kind in _PARTS.values() for f in fields(kind)]
