"""What one export asks for (`ExportConfig`, the flags of `mirror-rt export`), checked before anything is converted.

Apart from `exporters.export` (which imports torch and the model code), so that the CLI reads the export
defaults, and `devices.engines` catches `ExportError`, without importing either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORMATS = ("openvino", "onnx", "torch")
# the traced exporter's, then those of GGUF files and models over 1 GB (exporters.stream_export): a GGUF's own
# blocks, bf16 / f16 values, llama.cpp's 8- and 4-bit blocks of 32
WEIGHTS = ("fp32", "fp16", "int8", "int4", "q4_1", "w8a8", "gguf", "bf16", "f16", "q8_0", "q4_0")
STREAMED_ONLY = ("gguf", "bf16", "f16", "q8_0", "q4_0")
EXIT_WEIGHTS = ("fp32", "int8")
KV_MODES = ("explicit", "shared")
ATTENTION = ("pool", "standard")  # target attention of shared-KV ONNX graphs (ExportConfig.attention)
KV_DTYPES = ("fp32", "fp16")  # the target's KV buffers with pool attention (ExportConfig.kv_dtype)


class ExportError(ValueError):
    """An export request that cannot be satisfied (one-line message naming the option)."""


@dataclass(frozen=True)
class ExportConfig:
    """One export request; CLI flags map one to one onto these fields (`--format` is `fmt`, `--out` is `out_dir`),
    and the CLI reads their defaults here."""

    model: str | None  # target: preset, HF folder, .gguf, or None for the default model
    out_dir: Path  # bundle folder (created)
    draft_model: str | None = None  # None: the target itself with `draft_weights`
    exit_layer: int | None = None  # None: the model's default (models.config.SplitConfig)
    kappa: int | None = None  # early-exit candidates per position; None: the default (models.config.SplitConfig)
    fmt: str = "onnx"  # "onnx" | "openvino" | "torch" (onnx: exact and fastest on CPU here)
    weights: str = "auto"  # target weights; auto: a GGUF's own blocks (exporters.stream_export), else fp32
    draft_weights: str = "auto"  # draft weights; auto: see the module docstring
    static: bool = False  # fixed shapes (NPU); OpenVINO only
    max_context: int | None = None  # None: the model's context (static: 1024)
    max_window: int | None = None  # None: unbounded (static: 8)
    exit_adapter: str | None = None  # trained early-exit adapter (models.exit_adapter files); None: untrained exit
    exit_weights: str = "int8"  # exit graph weights (norm, adapter, LM head); torch bundles use the target's
    kv: str | None = None  # explicit (KV in and out: any backend) | shared (in place: ONNX Runtime); None: shared
                           # for onnx (fastest on ONNX Runtime: no cache copy per call), explicit otherwise
    draft_streams: str | None = None  # trained SS streams (mirror-rt train-draft --out) exported with the draft (onnx)
    draft_vocab: str | None = None  # kept ids (mirror-rt prune-vocab --out): the draft's LM head over those rows only
    attention: str | None = None  # targets of shared-KV ONNX graphs: pool (mirror-rt's op reads the KV in place:
                                  # exporters.pool_kv; a C++ compiler builds it here and where the bundle runs) |
                                  # standard (standard ops: exporters.exact_kv); None: pool where the op builds here
    kv_dtype: str | None = None  # the target's KV buffers with pool attention: fp32 | fp16 (half the memory and the
                                 # reads of attention); None: fp16 for w8a8 targets (their activations are int8
                                 # already), fp32 otherwise

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got '{self.fmt}'")
        for flag, value in (("--weights", self.weights), ("--draft-weights", self.draft_weights)):
            if value not in WEIGHTS and value != "auto":
                raise ExportError(f"{flag} must be one of {', '.join(WEIGHTS)}, got '{value}'")
            if value in ("q4_1", "w8a8") and self.fmt != "onnx":
                raise ExportError(f"{flag} {value} needs --format onnx (ONNX Runtime's integer products), "
                                  f"got --format {self.fmt}")
            if value in ("int8", "int4") and self.fmt == "torch":  # it was written as fp32, a warning said
                raise ExportError(f"{flag} {value} needs --format onnx or openvino; torch bundles keep fp32 or fp16 "
                                  "weights")
            if value in STREAMED_ONLY and self.fmt != "onnx":
                raise ExportError(f"{flag} {value} needs --format onnx (mirror-rt's own products)")
        if self.exit_weights not in EXIT_WEIGHTS:
            raise ExportError(f"--exit-weights must be one of {', '.join(EXIT_WEIGHTS)}, got '{self.exit_weights}'")
        if self.kv is None:
            object.__setattr__(self, "kv", "shared" if self.fmt == "onnx" else "explicit")
        if self.kv not in KV_MODES:
            raise ExportError(f"--kv must be one of {', '.join(KV_MODES)}, got '{self.kv}'")
        if self.kv == "shared" and self.fmt != "onnx":
            raise ExportError(f"--kv shared needs --format onnx (got --format {self.fmt})")
        if self.attention not in (None, *ATTENTION):
            raise ExportError(f"--attention must be one of {', '.join(ATTENTION)}, got '{self.attention}'")
        if self.kv_dtype not in (None, *KV_DTYPES):
            raise ExportError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got '{self.kv_dtype}'")
        if self.kv_dtype == "fp16" and (self.attention == "standard" or self.kv != "shared"):
            raise ExportError("--kv-dtype fp16 needs --attention pool (mirror-rt's op reads float16 KV; the "
                              "standard ops and GroupQueryAttention take float32)")
        if self.attention == "pool" and self.kv != "shared":
            raise ExportError(f"--attention pool needs --format onnx with --kv shared (got --format {self.fmt}, "
                              f"--kv {self.kv})")
        if self.static and self.fmt != "openvino":
            raise ExportError(f"--static needs --format openvino (got --format {self.fmt})")
        if self.draft_streams is not None and self.fmt != "onnx":
            raise ExportError(f"--draft-streams needs --format onnx (got --format {self.fmt}); for OpenVINO, "
                              "export --format onnx --kv explicit: its backend loads that draft graph")
        if self.draft_vocab is not None and (self.fmt == "torch" or self.draft_streams is not None):
            raise ExportError("--draft-vocab needs --format onnx or openvino and a plain draft "
                              f"(got --format {self.fmt}{' with --draft-streams' if self.draft_streams else ''})")
