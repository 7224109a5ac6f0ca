"""mirror-rt: Mirror Speculative Decoding across heterogeneous devices.

Public API (re-exports only; engines are assembled in `mirror_rt.devices.engines`):

    import mirror_rt
    engine = mirror_rt.load()                      # the default engine: SmolLM2-135M-Instruct's cached ONNX bundle
    result = engine.generate("What is the capital of France?", mode="mirror", max_new_tokens=64)
    print(result.text, result.stats["tokens_per_s"])
    for piece in engine.stream("Tell me a story", temperature=0.7, seed=1):
        print(piece, end="", flush=True)
    result = engine.generate("Name a city", constraint=mirror_rt.Constraint.json_schema(schema), logprobs=5)
    engine = mirror_rt.load(torch=True)            # the same model in torch eager
    engine = mirror_rt.load("path/to/hf-folder")   # any torch-only option runs torch
    engine = mirror_rt.load_bundle("bundles/smollm2-ov", target="cuda", draft="npu")
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Constraint", "Engine", "EngineConfig", "GenerationConfig", "GenerationError", "PromptError", "RulesConfig",
           "SamplingConfig", "__version__", "default_bundle", "load", "load_bundle"]

from importlib import import_module
from typing import TYPE_CHECKING

# where each public name lives: imported on first use, so `import mirror_rt` costs nothing until it is asked for
_EXPORTS = {"default_bundle": "mirror_rt.devices.engines", "EngineConfig": "mirror_rt.devices.options",
            "GenerationConfig": "mirror_rt.runtime.config", "Engine": "mirror_rt.runtime.engine",
            "GenerationError": "mirror_rt.runtime.engine", "PromptError": "mirror_rt.runtime.engine",
            "Constraint": "mirror_rt.runtime.grammar",
            "SamplingConfig": "mirror_rt.runtime.sampling", "RulesConfig": "mirror_rt.runtime.token_rules"}

if TYPE_CHECKING:
    from mirror_rt.devices.engines import default_bundle
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.runtime.config import GenerationConfig
    from mirror_rt.runtime.engine import Engine, GenerationError, PromptError
    from mirror_rt.runtime.grammar import Constraint
    from mirror_rt.runtime.sampling import SamplingConfig
    from mirror_rt.runtime.token_rules import RulesConfig


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mirror_rt' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def load(model: str | None = None, draft_model: str | None = None, *, log=None, **options) -> Engine:
    """The default engine with no arguments; torch eager with `torch=True` or any torch-only option.

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`); None: the default model.
        draft_model: `int8` (an int8 copy of the target, torch's default), `target` (the oracle draft),
            or a folder / .gguf / preset.
        options: the `mirror-rt run` engine flags by their names (`mirror_rt.EngineConfig` fields):
            device, dtype, threads, exit_layer, kappa, draft_streams, compile (torch-only: any of them runs
            torch eager), torch, bundle, draft_bundle, weights (the default model's target precision:
            fp32, int8, int4, q4_1, w8a8), target, draft, strict_devices, draft_precision,
            cache_dir, pin (torch, mirror: pin target and draft to different cores).
        log: where progress and warning lines go (None: stderr).
    """
    from mirror_rt.devices.engines import load_engine
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.devices.registry import stderr_line

    options = EngineConfig.from_flags(model=model, draft_model=draft_model, **options)
    return load_engine(options, log=log or stderr_line)


def load_bundle(bundle: str, *, mode: str | None = None, verify: bool = True, **options) -> Engine:
    """An engine over an exported bundle; `options` as `load`'s (target, draft, draft_bundle, strict_devices,
    draft_precision, threads), `mode` the mode it will mostly run (thread placement; None: Mirror)."""
    from mirror_rt.devices.bundle_engine import load_bundle as load_options
    from mirror_rt.devices.options import EngineConfig

    if bundle is None or not str(bundle).strip():
        raise ValueError(f"load_bundle needs a bundle's folder (mirror-rt export --out), got {bundle!r}")
    return load_options(EngineConfig.from_flags(bundle=bundle, **options), mode, verify)
