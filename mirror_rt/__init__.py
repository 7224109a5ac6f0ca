"""mirror-rt: Mirror Speculative Decoding across heterogeneous devices.

Public API:

    import mirror_rt
    engine = mirror_rt.load()                      # the embedded SmolLM2-135M-Instruct
    result = engine.generate("What is the capital of France?", mode="sd", max_new_tokens=64)
    print(result.text, result.stats["tokens_per_s"])
    for piece in engine.stream("Tell me a story", temperature=0.7, seed=1):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import sys
import warnings

__version__ = "0.1.0"
__all__ = ["load", "Engine", "GenerationConfig", "SamplingConfig", "__version__"]

from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.engine import Engine, GenerationError
from mirror_rt.runtime.sampling import SamplingConfig


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load(model: str | None = None, draft_model: str | None = None, *, device: str = "cpu",
         dtype: str = "float32", cache_dir: str | None = None, threads: int | None = None,
         log=_stderr) -> Engine:
    """Load a target (and optionally a draft) and return an `Engine`.

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`) or None for the default model.
        draft_model: same forms; None means the target drafts for itself (oracle draft).
        device: torch device for both models (`cpu`, `cuda`, `cuda:1`).
        dtype: weight dtype (`float32`, `bfloat16`, `float16`, `float64`).
        cache_dir: where the default model and converted GGUF files are kept.
        threads: torch intra-op threads (None: torch's default).
    """
    import torch

    from mirror_rt.devices.torch_backend import TorchModel
    from mirror_rt.models.loading import load_checkpoint

    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"device '{device}' requested but torch sees no CUDA device")
    target = load_checkpoint(model, dtype, cache_dir, log)
    names = {"target": target.source}
    draft = None
    if draft_model is not None:
        draft = load_checkpoint(draft_model, dtype, cache_dir, log)
        _check_vocabularies(target, draft)
        names["draft"] = draft.source
    return Engine(TorchModel(target.model, device), target.tokenizer,
                  TorchModel(draft.model, device) if draft else None, names)


def _check_vocabularies(target, draft) -> None:
    t, d = target.model.config.vocab_size, draft.model.config.vocab_size
    if t != d:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {t} tokens, "
                              f"draft {draft.source} has {d}")
    if target.tokenizer.sha256() != draft.tokenizer.sha256():
        warnings.warn("target and draft tokenizer files differ although the vocabulary sizes match; "
                      "token ids are compared directly", stacklevel=3)
