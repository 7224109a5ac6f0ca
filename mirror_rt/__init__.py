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
    engine = mirror_rt.load_bundle("bundles/smollm2-ov", target_device="cuda", draft_device="npu")
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Constraint", "Engine", "GenerationConfig", "GenerationError", "RulesConfig", "SamplingConfig",
           "__version__", "default_bundle", "load", "load_bundle"]

from mirror_rt.devices.engines import _stderr, default_bundle, load_bundle, load_engine
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.engine import Engine, GenerationError
from mirror_rt.runtime.grammar import Constraint
from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.runtime.token_rules import RulesConfig


def load(model: str | None = None, draft_model: str | None = None, *, device: str | None = None,
         dtype: str | None = None, cache_dir: str | None = None, threads: int | None = None,
         exit_layer: int | None = None, kappa: int | None = None, pin: bool = True,
         draft_streams: str | None = None, compile: bool | None = None, torch: bool = False,
         log=_stderr) -> Engine:
    """The default engine with no arguments; torch eager with `torch=True` or any torch-only option.

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`); None: the default model.
        draft_model: `int8` (an int8 copy of the target, torch's default), `target` (the oracle draft),
            or a folder / .gguf / preset.
        device, dtype, threads, exit_layer, kappa, draft_streams, compile: torch settings
            (see `mirror_rt.devices.engines.load_torch`).
        cache_dir: where the default model, its bundle and converted GGUF files are kept.
        pin: torch, mirror mode: pin target and draft to different cores.
        torch: run torch eager even when no torch-only option is given.
    """
    options = dict(model=model, draft_model=draft_model, device=device, dtype=dtype, threads=threads,
                   exit_layer=exit_layer, kappa=kappa, draft_streams=draft_streams, compile=compile)
    if not pin:
        options["pin"] = False
    return load_engine(torch=torch, torch_options=options, cache_dir=cache_dir, log=log)
