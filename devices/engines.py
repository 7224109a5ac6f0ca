"""Engine assembly: `load_engine` is the one place that decides what an engine runs (`run`, `serve`, `bench` and
`mirror_rt.load()` all come here): a named bundle, torch eager when asked for (any of options.TORCH_OPTIONS, or a
bundle-less `--target cuda`), a GGUF or large model from its own bundle, else the default model's cached ONNX bundle
(exported once). Loading is devices.bundle_engine's and devices.torch_engine's.
"""

from __future__ import annotations

import os
from pathlib import Path

from mirror_rt.devices.bundle_engine import load_bundle
from mirror_rt.devices.options import BUNDLE_WEIGHTS, EngineConfig
from mirror_rt.devices.placement import plan
from mirror_rt.devices.registry import names_torch_device, stderr_line, torch_target
from mirror_rt.devices.torch_engine import load_torch
from mirror_rt.models.default_model import DEFAULT_MODEL
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.engine import Engine, GenerationError

# part of the default bundle's folder name: bump when the default export changes (0.7.1: w8a8 weights in 7 bits,
# 4-bit targets row-invariant on AVX2)
BUNDLE_VERSION = "0.7.1"
# The default bundle's target precision: fp32, the GGUF's weights exactly (an int8 target answered the README's own
# question with nonsense; a q4_1 target costs what its q4_1 draft costs: docs/performance.md)
DEFAULT_WEIGHTS = "fp32"


def load_engine(options: EngineConfig | None = None, mode: str | None = None, log=stderr_line) -> Engine:
    """The engine for a request of the CLI, the server, the bench or the API; `mode`: the mode it will mostly run
    (thread placement; None: Mirror)."""
    options = options or EngineConfig()
    models = options.models
    if models.bundle is None and names_torch_device(options.devices.target):
        options = _torch_target(options, log)  # a usable GPU: torch there (a GGUF dequantized one tensor at a time)
    if models.bundle is None and not models.torch and options.devices.device is None and streams_model(models.model):
        return _model_bundle(options, mode, log)  # a GGUF or a model over 1 GB, from its own bundle
    asked = options.torch_asked()
    if models.bundle is not None and (models.torch or asked):
        raise GenerationError(f"a bundle runs as exported: {', '.join(asked) or 'torch'} applies to torch eager only "
                              "(drop it, or drop the bundle)")
    weights = options.precision.weights
    if weights is not None and (models.bundle is not None or models.torch or asked):
        raise GenerationError(f"--weights {weights} picks the default model's bundle at that precision: "
                              f"{'--bundle' if models.bundle else 'torch eager'} runs its own weights (drop one)")
    if models.bundle is None and not models.torch and not options.torch_asked():
        bundle = default_bundle(models.cache_dir, log=log, weights=weights) if weights else (
            default_bundle_or_none(models.cache_dir, log))
        if bundle is not None:
            engine = load_bundle(options.with_flags(bundle=str(bundle)), mode)
            engine.names["model"] = DEFAULT_MODEL
            return engine
    if models.bundle is not None:
        return load_bundle(options, mode)
    return load_torch(options, mode, log)


def streams_model(model: str | None) -> bool:
    """Whether `model` runs from a bundle of its own in the cache: a GGUF file or a Hugging Face folder over 1 GB."""
    if model is None or model in ("default", DEFAULT_MODEL):
        return False
    from mirror_rt.exporters.stream_export import streamed_source

    return streamed_source(model)


def _model_bundle(options: EngineConfig, mode: str | None, log) -> Engine:
    """`--model` (and `--draft-model`) exported once into a bundle in the cache, then loaded as `--bundle`."""
    models = options.models
    torch_only = [name for name in options.torch_asked() if name not in ("model", "draft_model")]
    if torch_only:
        raise GenerationError(f"{', '.join(torch_only)} applies to torch eager only: --model {models.model} runs "
                              "from its bundle (add --torch for torch eager)")
    draft = models.draft_model if models.draft_model not in (None, "int8", "target") else None
    if models.draft_model in ("int8", "target"):
        raise GenerationError(f"--draft-model {models.draft_model} is a torch draft: --model {models.model} runs "
                              "from its bundle, whose default draft is the target's own weights at 4 bits")
    weights = options.precision.weights or "auto"
    folder, draft_folder = model_bundles(models.model, draft, models.cache_dir, weights, log=log)
    flags = {"draft_bundle": str(draft_folder)} if draft_folder is not None else {}
    engine = load_bundle(options.with_flags(bundle=str(folder), model=None, draft_model=None, **flags), mode)
    engine.names["model"] = Path(models.model).name
    return engine


def model_bundles(model: str, draft: str | None = None, cache_dir: str | None = None, weights: str = "auto",
                  log=stderr_line) -> tuple[Path, Path | None]:
    """(the target's bundle, the draft's or None) in the cache. A draft that exports as the target does (a GGUF
    file, a folder over 1 GB: a family draft) has a bundle of its own (the one `--model` of the draft would run),
    so the target's is the one `--model` alone uses, exported once whatever the draft (a 7B target is not written
    again for each draft); the two bundles' tokens must be the same (their tokenizer.json: reading a GGUF's
    vocabulary takes seconds). Another draft is exported with the target, into one bundle."""
    if draft is None or not streams_model(draft):
        return model_bundle(model, draft, cache_dir, weights, log=log), None
    from mirror_rt.models.tokenizer_files import same_vocabulary

    folders = (model_bundle(draft, None, cache_dir, weights, log=log),  # the small one first
               model_bundle(model, None, cache_dir, weights, log=log))
    if not same_vocabulary(*folders):
        raise GenerationError(f"--draft-model {draft} must share the target's tokenizer (its vocabulary differs "
                              f"from {Path(model).name}'s)")
    return folders[1], folders[0]


def model_bundle(model: str, draft: str | None = None, cache_dir: str | None = None, weights: str = "auto",
                 progress: bool = True, log=stderr_line) -> Path:
    """The bundle of `model` (a GGUF file or a Hugging Face folder) in the cache, exported on first use into a folder
    named by a digest of the sources (path, size, time) and the precision: a changed file is exported again."""
    import hashlib

    from mirror_rt.exporters.manifest import FORMAT_VERSION
    from mirror_rt.exporters.stream_export import STREAM_VERSION
    from mirror_rt.models.default_model import cache_dir as resolve_cache

    key = [FORMAT_VERSION, STREAM_VERSION, weights]
    for source in (model, draft):
        if source is not None:
            path = Path(source).expanduser().resolve()
            stat = path.stat()
            key += [str(path), stat.st_size, stat.st_mtime_ns]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    folder = resolve_cache(cache_dir) / "bundles" / f"{Path(model).stem}-{digest}"
    message = f"mirror-rt: exporting {Path(model).name} once (weights as they lie, one tensor at a time), into {folder}"
    return _cached_bundle(folder, lambda out: export_bundle_of(model, out, progress, draft_model=draft,
                                                               weights=weights), message, log)


def export_bundle_of(model, out: Path, progress: bool, **options) -> None:
    from mirror_rt.exporters.export import export_bundle  # torch and the model code: only to export

    export_bundle(str(model), out, progress=progress, **options)


def _torch_target(options: EngineConfig, log) -> EngineConfig:
    """A bundle-less `--target` naming a torch device: that device for torch (`--device` must agree), or the default
    bundle's CPU target where a bare `cuda` cannot serve."""
    devices = options.devices
    device = torch_target(devices.target, devices.strict_devices, log)
    if device is None:
        return options.with_flags(target="cpu")
    if devices.device not in (None, device):
        raise GenerationError(f"--device {devices.device} and --target {devices.target} name different "
                              "target devices (give one)")
    return options.with_flags(device=device)


def default_bundle_or_none(cache_dir, log) -> Path | None:
    """The default bundle, or None (torch) with one warning line when it cannot be made here."""
    from mirror_rt.exporters.export_config import ExportError

    try:
        return default_bundle(cache_dir, log=log)
    except (ImportError, ExportError, OSError) as exc:
        log(f"mirror-rt: warning: no ONNX bundle of the default model ({exc}); running it in torch")
        return None


# what the first run of the default model takes, measured (issue 51: a busy 2-core machine; 4x that at a load average
# of 11 on the 2-core AMD EPYC here): fetch, GGUF conversion and export; or the export alone
FIRST_RUN = {False: "fetch ~93 MB, convert the GGUF, export: about 4 min on 2 cores, longer on a loaded machine; "
                    "later runs start in seconds",
             True: "about 2.5 min on 2 cores, longer on a loaded machine"}


def default_bundle(cache_dir: str | None = None, progress: bool = True, log=stderr_line,
                   weights: str | None = None) -> Path:
    """The default model's ONNX bundle in the cache with its target at `weights` (None: DEFAULT_WEIGHTS), exported on
    first use."""
    from mirror_rt.models.default_model import DEFAULT_MODEL, default_model_folder
    from mirror_rt.models.default_model import cache_dir as default_model_cache

    weights = weights or DEFAULT_WEIGHTS
    if weights not in BUNDLE_WEIGHTS:
        raise GenerationError(f"unknown --weights {weights} (the default bundle's: {', '.join(BUNDLE_WEIGHTS)})")
    folder = default_bundle_folder(cache_dir, weights)
    converted = (default_model_cache(cache_dir) / "models" / DEFAULT_MODEL / "model.safetensors").exists()
    message = (f"mirror-rt: exporting the default model to ONNX once ({FIRST_RUN[converted]}), into {folder}")
    return _cached_bundle(folder, lambda out: export_bundle_of(default_model_folder(cache_dir, log), out, progress,
                                                               weights=weights), message, log)


def _cached_bundle(folder: Path, export, message: str, log) -> Path:
    """`folder` when it holds a bundle, else `export(partial)` into a folder of this process, renamed into place at
    the end and removed if the export fails (one a killed process left is removed by the next export)."""
    import shutil

    from mirror_rt.exporters.manifest import BundleError, read_manifest
    from mirror_rt.exporters.paths import OutputPathError, check_writable, sweep_partials

    try:
        read_manifest(folder, verify=False)
        return folder
    except BundleError:
        pass
    try:  # a cache that cannot hold the model cannot run it in torch either: one error, before any work
        check_writable(folder.parent)
    except OutputPathError as exc:
        raise OutputPathError(f"the model cache cannot be used (--cache-dir, $MIRROR_RT_CACHE): {exc}") from None
    log(message)
    sweep_partials(folder)  # what an export killed mid-way left (a server stopped while it loaded)
    partial = Path(f"{folder}.partial-{os.getpid()}")  # one per process: two first runs never share one
    try:
        export(partial)
        try:
            read_manifest(folder, verify=False)  # another process finished first: keep its bundle
        except BundleError:
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def placements_here() -> list[str]:
    """Where `run` (mirror) puts its workers on this machine: the default bundle, and `--target cuda` with a GPU."""
    import torch

    cores = sorted(available_cores())
    lines = [f"run (mirror): {plan('ort:cpu', 'ort:cpu', 'mirror', cores).describe()}"]
    if torch.cuda.device_count():
        lines.append(f"run --target cuda (mirror): {plan('torch:cuda:0', 'ort:cpu', 'mirror', cores).describe()}")
    return lines


def default_bundle_folder(cache_dir: str | None = None, weights: str | None = None) -> Path:
    """Where the default model's bundle with its target at `weights` (None: DEFAULT_WEIGHTS) lives in the cache."""
    from mirror_rt.models.default_model import cache_dir as resolve_cache

    suffix = "" if weights in (None, DEFAULT_WEIGHTS) else f"-{weights}"
    return resolve_cache(cache_dir) / "bundles" / f"smollm2-135m-instruct-onnx-{BUNDLE_VERSION}{suffix}"


def draft_choice_here(cache_dir: str | None = None) -> list[str]:
    """`mirror-rt devices`: where `--draft auto` puts the default bundle's draft here (with its table when it had a
    choice), loading the default engine when it is exported."""
    from mirror_rt.exporters.manifest import BundleError, read_manifest

    folder = default_bundle_folder(cache_dir)
    try:
        read_manifest(folder, verify=False)
    except BundleError:
        return ["draft auto: the default bundle is not exported yet (mirror-rt run exports it)"]
    engine = load_bundle(EngineConfig.from_flags(bundle=str(folder), draft="auto"), verify=False)
    return list(engine.draft_auto)
