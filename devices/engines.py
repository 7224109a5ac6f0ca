"""Engine assembly: which models run where, and the one default engine.

`load_engine` is the single place that decides what an engine runs: a bundle when one is named,
torch eager when asked for (`torch=True` or any torch-only option), else the default model's
cached ONNX bundle (exported once, with a progress bar). `mirror-rt run`, `serve`, `bench` and
`mirror_rt.load()` all come here, so they run the same engine for the same request. Torch-only
options are None when not given: the choice never depends on comparing values with defaults.
Every engine records the path it runs and each role's precision in `engine.names`.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

from mirror_rt.models.default_model import DEFAULT_MODEL
from mirror_rt.runtime.engine import Engine, GenerationError

# Options only the torch eager engine understands: setting any of them asks for torch.
TORCH_OPTIONS = ("model", "draft_model", "device", "dtype", "threads", "exit_layer", "kappa", "draft_streams")
BUNDLE_VERSION = "0.1.0"  # part of the default bundle's folder name: bump when the default export changes


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_engine(bundle: str | None = None, *, torch: bool = False, torch_options: dict | None = None,
                target_device: str = "cpu", draft_device: str = "cpu", draft_bundle: str | None = None,
                strict_devices: bool = False, mode: str = "mirror", draft_precision: str | None = None,
                cache_dir: str | None = None, log=_stderr) -> Engine:
    """The engine for a request of the CLI, the server, the bench or the API.

    Args:
        bundle: an exported bundle; None: the default bundle unless torch is asked for.
        torch: run torch eager even with no torch option.
        torch_options: `load_torch` keyword options (TORCH_OPTIONS); None values count as not given.
        target_device, draft_device, draft_bundle, strict_devices, draft_precision: bundle placement.
        mode: the mode the engine will mostly run (thread placement of bundles).
    """
    options = {k: v for k, v in (torch_options or {}).items() if v is not None}
    unknown = set(options) - set(TORCH_OPTIONS) - {"pin"}
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    asked = sorted(set(options) & set(TORCH_OPTIONS))
    if bundle is not None and (torch or asked):
        raise GenerationError(f"a bundle runs as exported: {', '.join(asked) or 'torch'} applies to torch eager only "
                              "(drop it, or drop the bundle)")
    if bundle is None and not torch and not asked:
        bundle = _default_bundle_or_none(cache_dir, log)
        default = bundle is not None
    else:
        default = False
    if bundle is not None:
        engine = load_bundle(str(bundle), target_device=target_device, draft_device=draft_device,
                             draft_bundle=draft_bundle, strict_devices=strict_devices, mode=mode,
                             draft_precision=draft_precision)
        if default:
            engine.names["model"] = DEFAULT_MODEL
        return engine
    return load_torch(**options, cache_dir=cache_dir, log=log)


def _default_bundle_or_none(cache_dir, log) -> Path | None:
    """The default bundle, or None (torch) with one warning line when it cannot be made here."""
    from mirror_rt.exporters.export import ExportError

    try:
        return default_bundle(cache_dir, log=log)
    except (ImportError, ExportError, OSError) as exc:
        log(f"mirror-rt: warning: no ONNX bundle of the default model ({exc}); running it in torch")
        return None


def load_torch(model: str | None = None, draft_model: str | None = "int8", *, device: str | None = None,
               dtype: str | None = None, cache_dir: str | None = None, threads: int | None = None,
               exit_layer: int | None = None, kappa: int | None = None, pin: bool = True,
               draft_streams: str | None = None, log=_stderr) -> Engine:
    """A torch eager engine: a target (and a draft) as torch modules.

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`) or None for the default model.
        draft_model: `int8` (default: an int8 copy of the target), `target` (the target drafts
            for itself: the oracle draft, for checks), or a folder / .gguf / preset.
        device: torch device for the target (`cpu` by default, `cuda`, `cuda:1`); the draft stays on cpu.
        dtype: target weight dtype (`float32` by default, `bfloat16`, `float16`, `float64`).
        threads: torch intra-op threads (None: torch's default; mirror mode pins one core each).
        exit_layer: early-exit layer for mirror mode (default N/2); kappa: candidates per position (8).
        pin: in mirror mode on a machine with 2+ cores, pin target and draft to different cores.
        draft_streams: a `mirror-rt train-draft` folder: the draft gets its trained SS streams.
    """
    import torch
    from mirror_rt.devices.torch_backend import TorchModel
    from mirror_rt.devices.torch_split import TorchSplitTarget
    from mirror_rt.models.loading import load_checkpoint

    device, dtype = device or "cpu", dtype or "float32"
    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"device '{device}' requested but torch sees no CUDA device")
    target = load_checkpoint(model, dtype, cache_dir, log)
    names = {"model": Path(target.source).name, "target": target.source, "path": f"torch eager ({device})",
             "target_precision": _dtype_name(dtype), "target_device": f"torch:{device}", "draft_device": "torch:cpu"}
    draft = _load_draft(draft_model or "int8", target, dtype, cache_dir, log)
    names["draft_precision"] = "int8" if draft_model in (None, "int8") else names["target_precision"]
    if draft is not None:
        names["draft"] = "int8 copy of the target" if draft_model in (None, "int8") else str(draft_model)
    cores = sorted(available_cores())
    cpus = (cores[0], cores[1]) if pin and len(cores) >= 2 and not device.startswith("cuda") else None
    draft_model_ = TorchModel(draft, "cpu") if draft is not None else None
    if draft_streams:
        from mirror_rt.devices.torch_streams import TorchStreamDraft
        from mirror_rt.models.ss_draft import load_streams

        base = draft if draft is not None else target.model
        draft_model_ = TorchStreamDraft(load_streams(base, draft_streams), "cpu")
        names["draft"] = f"{names.get('draft', 'target')} + SS streams from {draft_streams}"
    split = TorchSplitTarget(target.model, exit_layer, kappa or 8, device)
    return Engine(split, target.tokenizer, draft_model_, names, cpus)


def load_bundle(bundle: str, *, target_device: str = "cpu", draft_device: str = "cpu",
                draft_bundle: str | None = None, strict_devices: bool = False, mode: str = "mirror",
                draft_precision: str | None = None, verify: bool = True, threads: int | None = None) -> Engine:
    """An `Engine` over an exported bundle (`mirror-rt export`).

    Args:
        bundle: the bundle folder (its target, and its draft unless `draft_bundle` is given).
        target_device, draft_device: device strings (`cpu`, `cuda`, `npu`, `openvino:CPU`, `ort:cpu`...);
            a missing device falls back to the fastest CPU backend with a warning.
        draft_bundle: take the draft from another bundle (same vocabulary) instead.
        strict_devices: refuse to fall back.
        mode: the mode the engine will mostly run: mirror gives each worker one core (2+ cores),
            ar/sd give the target every core. With mirror on ONNX Runtime CPU the target also holds a
            second pair of sessions over both cores for prompts, where a second copy of its weights
            takes at most a quarter of the available memory.
        draft_precision: OpenVINO CPU compute precision of the draft (`bf16` is faster on CPUs with
            bf16 support and never changes the output, only acceptance); the target is always exact.
        verify: check every file's sha256 against the manifest.
        threads: compute threads of each worker, unpinned (None: as `mode` places them).
    """
    from mirror_rt.devices.registry import WorkerBudget, draft_copies_target, load_tokenizer
    from mirror_rt.exporters.manifest import read_manifest

    manifest = read_manifest(bundle, verify=verify)
    draft_source = draft_bundle or bundle
    draft_manifest = manifest if draft_source == bundle else read_manifest(draft_source, verify=verify)
    if draft_manifest.vocab_size != manifest.vocab_size:
        raise GenerationError(f"vocabulary mismatch: target bundle has {manifest.vocab_size} tokens, "
                              f"draft bundle has {draft_manifest.vocab_size}")
    cores = sorted(available_cores())
    pinned = threads is None and mode == "mirror" and len(cores) >= 2
    if pinned:
        target_budget = WorkerBudget(1, (cores[0],), None, (cores[0], cores[1]))
        draft_budget = WorkerBudget(1, (cores[1],), draft_precision)
    else:
        target_budget = WorkerBudget(threads or len(cores))
        draft_budget = WorkerBudget(threads or len(cores), None, draft_precision)
    target = _in_worker_thread(bundle, manifest, "target", target_device, strict_devices, target_budget)
    draft = _in_worker_thread(draft_source, draft_manifest, "draft", draft_device, strict_devices, draft_budget)
    draft.same_model_as_target = draft_copies_target(manifest, draft_manifest)
    names = {"model": Path(bundle).name, "target": f"{bundle} ({type(target).__name__})",
             "draft": f"{draft_source} ({type(draft).__name__})", "path": f"{manifest.graph_format} bundle",
             "target_device": target.placement.actual, "draft_device": draft.placement.actual,
             "target_precision": manifest.graph("target_prefix").precision,
             "draft_precision": draft_manifest.graph("draft").precision}
    engine = Engine(target, load_tokenizer(Path(bundle), manifest), draft, names,
                    (cores[0], cores[1]) if pinned else None)
    engine.manifest = manifest
    engine.placement = {"target": target.placement, "draft": draft.placement}
    return engine


def default_bundle(cache_dir: str | None = None, progress: bool = True, log=_stderr) -> Path:
    """The default model's ONNX bundle in the cache (`mirror-rt export` defaults), exported on first use.

    ONNX Runtime graphs decode the default model about 4x faster on CPU than torch eager, and Mirror
    then beats target-only decoding. The export (~30 s here) writes into a temporary folder of this
    process, renamed at the end and removed if the export fails, so an interrupted export leaves
    nothing behind. The folder name carries the bundle version.
    """
    import shutil

    from mirror_rt.exporters.export import export_bundle
    from mirror_rt.exporters.manifest import BundleError, read_manifest
    from mirror_rt.models.default_model import cache_dir as resolve_cache
    from mirror_rt.models.default_model import default_model_folder

    folder = resolve_cache(cache_dir) / "bundles" / f"smollm2-135m-instruct-onnx-{BUNDLE_VERSION}"
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


def available_cores() -> set:
    """The cores this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _in_worker_thread(folder, manifest, role, device, strict, budget):
    """Load one model in a short-lived thread pinned like its worker, so backend pools inherit the pin."""
    from mirror_rt.devices.registry import load_model

    result = {}

    def work():
        try:
            result["model"] = load_model(Path(folder), manifest, role, device, strict, budget)
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

    if draft_model == "target":
        return None
    if draft_model == "int8":
        return int8_copy(target.model)
    draft = load_checkpoint(draft_model, dtype, cache_dir, log)
    _check_vocabularies(target, draft)
    return draft.model


def _dtype_name(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, dtype)


def _check_vocabularies(target, draft) -> None:
    t, d = target.model.config.vocab_size, draft.model.config.vocab_size
    if t != d:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {t} tokens, "
                              f"draft {draft.source} has {d}")
    if target.tokenizer.sha256() != draft.tokenizer.sha256():
        warnings.warn("target and draft tokenizer files differ although the vocabulary sizes match; "
                      "token ids are compared directly", stacklevel=3)
