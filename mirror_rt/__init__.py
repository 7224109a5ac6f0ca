"""mirror-rt: Mirror Speculative Decoding across heterogeneous devices.

Public API:

    import mirror_rt
    engine = mirror_rt.load()                      # the embedded SmolLM2-135M-Instruct, int8 self-draft (torch)
    engine = mirror_rt.load_bundle(mirror_rt.default_bundle())  # the same model as an ONNX bundle: ~4x faster
    result = engine.generate("What is the capital of France?", mode="mirror", max_new_tokens=64)
    print(result.text, result.stats["tokens_per_s"])
    for piece in engine.stream("Tell me a story", temperature=0.7, seed=1):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import sys
import warnings

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationConfig", "SamplingConfig", "__version__", "default_bundle", "load", "load_bundle"]

from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.engine import Engine, GenerationError
from mirror_rt.runtime.sampling import SamplingConfig


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load(model: str | None = None, draft_model: str | None = "int8", *, device: str = "cpu",
         dtype: str = "float32", cache_dir: str | None = None, threads: int | None = None,
         exit_layer: int | None = None, kappa: int = 8, pin: bool = True, draft_streams: str | None = None,
         log=_stderr) -> Engine:
    """Load a target (and a draft) and return an `Engine`.

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`) or None for the default model.
        draft_model: `int8` (default: an int8 copy of the target), `target` (the target drafts
            for itself: the oracle draft, for checks), or a folder / .gguf / preset.
        device: torch device for the target (`cpu`, `cuda`, `cuda:1`); the draft stays on cpu.
        dtype: target weight dtype (`float32`, `bfloat16`, `float16`, `float64`).
        cache_dir: where the default model and converted GGUF files are kept.
        threads: torch intra-op threads (None: torch's default; mirror mode pins one core each).
        exit_layer: early-exit layer for mirror mode (default N/2); kappa: candidates per position.
        pin: in mirror mode on a machine with 2+ cores, pin target and draft to different cores.
        draft_streams: a `mirror-rt train-draft` folder: the draft gets its trained SS streams
            (greedy Mirror rollouts then confirm several tokens per draft forward).
    """
    import torch

    from mirror_rt.devices.torch_backend import TorchModel
    from mirror_rt.devices.torch_split import TorchSplitTarget
    from mirror_rt.models.loading import load_checkpoint

    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"device '{device}' requested but torch sees no CUDA device")
    target = load_checkpoint(model, dtype, cache_dir, log)
    names = {"target": target.source}
    draft = _load_draft(draft_model, target, dtype, cache_dir, log)
    if draft is not None:
        names["draft"] = "int8 copy of the target" if draft_model == "int8" else str(draft_model)
    cores = sorted(_cores())
    cpus = (cores[0], cores[1]) if pin and len(cores) >= 2 and not device.startswith("cuda") else None
    draft_model_ = TorchModel(draft, "cpu") if draft is not None else None
    if draft_streams:
        from mirror_rt.devices.torch_streams import TorchStreamDraft
        from mirror_rt.models.ss_training import load_streams

        base = draft if draft is not None else target.model
        draft_model_ = TorchStreamDraft(load_streams(base, draft_streams), "cpu")
        names["draft"] = f"{names.get('draft', 'target')} + SS streams from {draft_streams}"
    return Engine(TorchSplitTarget(target.model, exit_layer, kappa, device), target.tokenizer,
                  draft_model_, names, cpus)


def load_bundle(bundle: str, *, target_device: str = "cpu", draft_device: str = "cpu",
                draft_bundle: str | None = None, strict_devices: bool = False, mode: str = "mirror",
                draft_precision: str | None = None, verify: bool = True) -> Engine:
    """An `Engine` over an exported bundle (`mirror-rt export`).

    Args:
        bundle: the bundle folder (its target, and its draft unless `draft_bundle` is given).
        target_device, draft_device: device strings (`cpu`, `cuda`, `npu`, `openvino:CPU`, `ort:cpu`...);
            a missing device falls back to the fastest CPU backend with a warning.
        draft_bundle: take the draft from another bundle (same vocabulary) instead.
        strict_devices: refuse to fall back.
        draft_precision: OpenVINO CPU compute precision of the draft (`bf16` is faster on CPUs with
            bf16 support and never changes the output, only acceptance); the target is always exact.
        mode: the mode the engine will mostly run: mirror gives each worker one core (2+ cores),
            ar/sd give the target every core. With mirror on ONNX Runtime CPU the target also holds a
            second pair of sessions over both cores for prompts, where a second copy of its weights
            takes at most a quarter of the available memory.
    """
    from mirror_rt.exporters.manifest import read_manifest

    cores = sorted(_cores())
    pinned = mode == "mirror" and len(cores) >= 2
    target_budget = (1, (cores[0],), None, (cores[0], cores[1])) if pinned else (len(cores), None)
    draft_budget = (1, (cores[1],), draft_precision) if pinned else (len(cores), None, draft_precision)
    manifest = read_manifest(bundle, verify=verify)
    draft_source = draft_bundle or bundle
    draft_manifest = manifest if draft_source == bundle else read_manifest(draft_source, verify=verify)
    if draft_manifest.vocab_size != manifest.vocab_size:
        raise GenerationError(f"vocabulary mismatch: target bundle has {manifest.vocab_size} tokens, "
                              f"draft bundle has {draft_manifest.vocab_size}")
    target = _in_worker_thread(bundle, manifest, "target", target_device, strict_devices, target_budget)
    draft = _in_worker_thread(draft_source, draft_manifest, "draft", draft_device, strict_devices, draft_budget)
    from mirror_rt.devices.registry import draft_copies_target, load_tokenizer

    draft.same_model_as_target = draft_copies_target(manifest, draft_manifest)

    names = {"target": f"{bundle} ({type(target).__name__})", "draft": f"{draft_source} ({type(draft).__name__})"}
    return Engine(target, load_tokenizer(__import__("pathlib").Path(bundle), manifest), draft, names,
                  (cores[0], cores[1]) if pinned else None)


def default_bundle(cache_dir: str | None = None, progress: bool = True, log=_stderr):
    """The default model's ONNX bundle in the cache (`mirror-rt export` defaults), exported on first use.

    `mirror-rt run` without --model/--bundle runs this bundle: ONNX Runtime graphs decode the default
    model about 4x faster on CPU than torch eager, and Mirror then beats target-only decoding. The
    export (~30 s here) writes into a temporary folder of this process, renamed at the end and removed
    if the export fails, so an interrupted export leaves nothing behind. The folder name carries the
    mirror-rt version.
    """
    import os
    import shutil
    from pathlib import Path

    from mirror_rt.exporters.export import export_bundle
    from mirror_rt.exporters.manifest import BundleError, read_manifest
    from mirror_rt.models.default_model import cache_dir as resolve_cache
    from mirror_rt.models.default_model import default_model_folder

    folder = resolve_cache(cache_dir) / "bundles" / f"smollm2-135m-instruct-onnx-{__version__}"
    try:
        read_manifest(folder, verify=False)
        return folder
    except BundleError:
        pass
    log(f"mirror-rt: exporting the default model to ONNX once (about 30 s), into {folder}")
    partial = Path(f"{folder}.partial-{os.getpid()}")  # one per process: two first runs never share one
    try:
        export_bundle(str(default_model_folder(cache_dir, log)), partial, progress=progress)
        try:
            read_manifest(folder, verify=False)  # another process finished first: keep its bundle
        except BundleError:
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _in_worker_thread(folder, manifest, role, device, strict, budget):
    """Load one model in a short-lived thread pinned like its worker, so backend pools inherit the pin."""
    import threading

    from mirror_rt.devices.registry import WorkerBudget, load_model

    result = {}

    def work():
        try:
            result["model"] = load_model(__import__("pathlib").Path(folder), manifest, role, device, strict,
                                         WorkerBudget(*budget))
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name=f"load-{role}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["model"]


def _load_draft(draft_model, target, dtype, cache_dir, log):
    """The draft's torch module, or None for the oracle draft (the target itself)."""
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.models.quantize import int8_copy

    if draft_model in (None, "target"):
        return None
    if draft_model == "int8":
        return int8_copy(target.model)
    draft = load_checkpoint(draft_model, dtype, cache_dir, log)
    _check_vocabularies(target, draft)
    return draft.model


def _cores() -> set:
    import os

    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _check_vocabularies(target, draft) -> None:
    t, d = target.model.config.vocab_size, draft.model.config.vocab_size
    if t != d:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {t} tokens, "
                              f"draft {draft.source} has {d}")
    if target.tokenizer.sha256() != draft.tokenizer.sha256():
        warnings.warn("target and draft tokenizer files differ although the vocabulary sizes match; "
                      "token ids are compared directly", stacklevel=3)
