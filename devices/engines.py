"""Engine assembly: which models run where, and the one default engine.

`load_engine` is the single place that decides what an engine runs: a bundle when one is named,
torch eager when asked for (`torch=True` or any torch-only option), else the default model's
cached ONNX bundle (exported once, with a progress bar). `mirror-rt run`, `serve`, `bench` and
`mirror_rt.load()` all come here, so they run the same engine for the same request. Torch-only
options are None when not given: the choice never depends on comparing values with defaults.
Every engine records the path it runs, each role's precision and its load time in `engine.names`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path

from mirror_rt.devices.placement import is_accelerator, plan
from mirror_rt.models.default_model import DEFAULT_MODEL
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.engine import Engine, GenerationError

# Options only the torch engine understands: setting any of them asks for torch.
TORCH_OPTIONS = ("model", "draft_model", "device", "dtype", "threads", "exit_layer", "kappa", "draft_streams",
                 "compile")
BUNDLE_VERSION = "0.1.0"  # part of the default bundle's folder name: bump when the default export changes
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


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
        target_device: with a bundle, its target's device; without one, a torch device (`cuda`, `cuda:1`,
            `torch:cpu`) runs the target in torch there (a CUDA target: bf16 by default, the draft on
            `draft_device`: the default bundle's draft for the default model), other devices the default bundle.
        draft_device, draft_bundle, strict_devices, draft_precision: placement of bundles and bundle drafts.
        mode: the mode the engine will mostly run (thread placement).
    """
    options = {k: v for k, v in (torch_options or {}).items() if v is not None}
    unknown = set(options) - set(TORCH_OPTIONS) - {"pin"}
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    asked = sorted(set(options) & set(TORCH_OPTIONS))
    if bundle is not None and (torch or asked):
        raise GenerationError(f"a bundle runs as exported: {', '.join(asked) or 'torch'} applies to torch eager only "
                              "(drop it, or drop the bundle)")
    if bundle is None and names_torch_device(target_device):
        device = torch_target(target_device, strict_devices, log)
        if device is None:  # a bare `cuda` torch cannot serve (warned): the default bundle on the CPU
            target_device = "cpu"
        elif options.get("device", device) != device:
            raise GenerationError(f"--device {options['device']} and --target {target_device} name different "
                                  "target devices (give one)")
        else:
            options["device"] = device
    if bundle is None and not torch and not options:
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
    return load_torch(**options, draft_device=draft_device, draft_bundle=draft_bundle, draft_precision=draft_precision,
                      strict_devices=strict_devices, mode=mode, cache_dir=cache_dir, log=log)


def names_torch_device(target_device: str) -> bool:
    """Whether a bundle-less `--target` asks for torch: `cuda[:N]`, `torch:cpu`, `torch:cuda[:N]`."""
    from mirror_rt.devices.registry import parse_device

    spec = parse_device(target_device)
    return spec.backend == "torch" or (spec.backend == "auto" and spec.device == "cuda")


def torch_target(target_device: str, strict: bool = False, log=_stderr) -> str | None:
    """The torch device of a bundle-less `--target` naming one (`cuda`, `cuda:1`, `torch:cpu`, `torch:cuda`).

    A device torch cannot serve: DeviceError when strict; else `torch:cuda` falls back to the CPU with a
    warning, and a bare `cuda` returns None after one warning line naming what is missing (the default
    bundle then runs on the CPU).
    """
    import torch
    from mirror_rt.devices.registry import DeviceError, DeviceFallbackWarning, parse_device

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
    log(f"mirror-rt: warning: {reason}; running the default model's bundle on the CPU")
    return None


def _default_bundle_or_none(cache_dir, log) -> Path | None:
    """The default bundle, or None (torch) with one warning line when it cannot be made here."""
    from mirror_rt.exporters.export import ExportError

    try:
        return default_bundle(cache_dir, log=log)
    except (ImportError, ExportError, OSError) as exc:
        log(f"mirror-rt: warning: no ONNX bundle of the default model ({exc}); running it in torch")
        return None


def default_dtype(device: str) -> str:
    """bf16 on CUDA (fp16 where the GPU has no bf16), fp32 elsewhere."""
    import torch

    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def load_torch(model: str | None = None, draft_model: str | None = None, *, device: str | None = None,
               dtype: str | None = None, cache_dir: str | None = None, threads: int | None = None,
               exit_layer: int | None = None, kappa: int | None = None, pin: bool = True,
               draft_streams: str | None = None, compile: bool | None = None, draft_device: str = "cpu",
               draft_bundle: str | None = None, draft_precision: str | None = None, strict_devices: bool = False,
               mode: str = "mirror", log=_stderr) -> Engine:
    """A torch engine: the target as a torch module on `device`, the draft on the CPU (torch or a bundle's).

    Args:
        model: a Hugging Face folder, a .gguf file, a preset (`tiny`) or None for the default model.
        draft_model: `int8` (an int8 copy of the target: the default except below), `target` (the target
            drafts for itself: the oracle draft, for checks), or a folder / .gguf / preset.
            None with the default model on an accelerator: the default bundle's draft (ONNX Runtime, CPU).
        device: torch device of the target (`cpu` by default, `cuda`, `cuda:1`).
        dtype: target weight dtype (default bf16 on CUDA, fp16 where bf16 is missing, else fp32; `float32`,
            `bfloat16`, `float16`, `float64` or bf16 / fp16 / fp32). The reference (`ar`) runs at this precision.
        threads: torch intra-op threads (None: torch's default; mirror mode pins one core each).
        exit_layer: early-exit layer for mirror mode (default N/2); kappa: candidates per position (8).
        pin: in mirror mode with both models on a 2+ core CPU, pin target and draft to different cores.
        draft_streams: a `mirror-rt train-draft` folder: the draft gets its trained SS streams.
        compile: static-shape verify windows under `torch.compile` (CUDA graphs on CUDA, inductor on CPU).
        draft_device, draft_bundle, draft_precision: a bundle's draft and where it runs.
    """
    import torch
    from mirror_rt.devices.torch_split import TorchSplitTarget
    from mirror_rt.models.loading import load_checkpoint

    started = time.perf_counter()
    device = device or "cpu"
    dtype = {v: k for k, v in DTYPE_NAMES.items()}.get(dtype, dtype) or default_dtype(device)
    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"device '{device}' requested but torch sees no CUDA device")
    target = load_checkpoint(model, dtype, cache_dir, log)
    use_bundle = not draft_streams and (draft_bundle or (draft_model is None and model is None
                                                         and is_accelerator(device)))
    folder = (draft_bundle or _default_bundle_or_none(cache_dir, log)) if use_bundle else None
    if folder is not None:
        manifest, where = _bundle_draft_device(folder, target, draft_device, strict_devices)
    else:
        manifest, where = None, _torch_draft_device(draft_device, strict_devices)
    placement = plan(f"torch:{device}", where, mode, sorted(available_cores()))
    if folder is not None:
        draft, names = _bundle_draft(folder, manifest, where, placement, draft_precision)
    else:
        draft, names = _torch_draft(draft_model or "int8", draft_streams, target, dtype, cache_dir, log)
    names |= {"model": Path(target.source).name, "target": target.source,
              "path": f"torch {'compiled' if compile else 'eager'} ({device})", "target_precision": DTYPE_NAMES[dtype],
              "placement": placement.describe(), "target_device": f"torch:{device}", "draft_device": str(where)}
    split = TorchSplitTarget(target.model, exit_layer, kappa or 8, device, compile=bool(compile))
    if compile:  # compiled code is specialized on torch's thread count: warm up at the mode's
        log(f"mirror-rt: compiling the target's windows for {device} (torch.compile, once per process)")
        previous = torch.get_num_threads()
        torch.set_num_threads(placement.target_threads or previous)
        try:
            split.warm_up()
        finally:
            torch.set_num_threads(previous)
    names["load_time_s"] = round(time.perf_counter() - started, 3)  # every generation's stats carry it
    return Engine(split, target.tokenizer, draft, names, placement.worker_cores if pin else None)


def _bundle_draft_device(folder, target, draft_device: str, strict: bool):
    """(manifest, resolved device) of a bundle's draft for a torch target; refuses another vocabulary."""
    from mirror_rt.devices.registry import bundle_format, resolve
    from mirror_rt.exporters.manifest import read_manifest

    manifest = read_manifest(folder, verify=False)
    if manifest.vocab_size != target.model.config.vocab_size:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {target.model.config.vocab_size} "
                              f"tokens, draft bundle {folder} has {manifest.vocab_size}")
    return manifest, resolve(draft_device, strict, bundle_format(manifest, "draft"))


def _bundle_draft(folder, manifest, where, placement, precision: str | None):
    """A bundle's draft loaded on `where` with the placement's draft share; returns (model, names)."""
    from mirror_rt.devices.registry import WorkerBudget

    budget = WorkerBudget(placement.draft_threads, placement.draft_cpus, precision)
    draft = _in_worker_thread(folder, manifest, "draft", where, True, budget)
    draft.same_model_as_target = False  # its KV lives in another backend's caches: it prefills itself
    return draft, {"draft": f"{folder} ({type(draft).__name__})", "draft_precision": manifest.graph("draft").precision}


def _torch_draft_device(draft_device: str, strict: bool) -> str:
    """Torch drafts run on the CPU (torch's int8 kernels are CPU kernels): say so when asked for another device."""
    from mirror_rt.devices.registry import DeviceError, DeviceFallbackWarning

    if is_accelerator(draft_device):
        reason = (f"draft device '{draft_device}' unusable here: the torch draft (int8 copy or --draft-model) runs "
                  "on the CPU only; give --draft-bundle for a draft on another device")
        if strict:
            raise DeviceError(f"{reason} (strict devices: no fallback)")
        warnings.warn(f"{reason}; using 'torch:cpu' instead", DeviceFallbackWarning, stacklevel=3)
    return "torch:cpu"


def _torch_draft(draft_model: str, draft_streams: str | None, target, dtype: str, cache_dir, log):
    """The torch draft on the CPU (None: the target drafts for itself); returns (model, names)."""
    from mirror_rt.devices.torch_backend import TorchModel

    draft = _load_draft(draft_model, target, dtype, cache_dir, log)
    names = {"draft_precision": "int8" if draft_model == "int8" else DTYPE_NAMES[dtype]}
    if draft is not None:
        names["draft"] = "int8 copy of the target" if draft_model == "int8" else str(draft_model)
    model = TorchModel(draft, "cpu") if draft is not None else None
    if draft_streams:
        from mirror_rt.devices.torch_streams import TorchStreamDraft
        from mirror_rt.models.ss_draft import load_streams

        model = TorchStreamDraft(load_streams(draft if draft is not None else target.model, draft_streams), "cpu")
        names["draft"] = f"{names.get('draft', 'target')} + SS streams from {draft_streams}"
    return model, names


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
        mode: the mode the engine will mostly run (devices.placement): mirror with both models on the CPU
            gives each worker one core (2+ cores), ar/sd give the target every core, and a target on an
            accelerator is not pinned while a CPU draft gets every core. With mirror on ONNX Runtime CPU the
            target also holds a
            second pair of sessions over both cores for prompts, where a second copy of its weights
            takes at most a quarter of the available memory.
        draft_precision: OpenVINO CPU compute precision of the draft (`bf16` is faster on CPUs with
            bf16 support and never changes the output, only acceptance); the target is always exact.
        verify: check every file's sha256 against the manifest.
        threads: compute threads of each worker, unpinned (None: as `mode` places them).
    """
    from mirror_rt.devices.registry import (
        Placement,
        WorkerBudget,
        adopts_from,
        bundle_format,
        draft_copies_target,
        load_tokenizer,
        resolve_noted,
    )
    from mirror_rt.exporters.manifest import read_manifest

    started = time.perf_counter()
    manifest = read_manifest(bundle, verify=verify)
    draft_source = draft_bundle or bundle
    draft_manifest = manifest if draft_source == bundle else read_manifest(draft_source, verify=verify)
    if draft_manifest.vocab_size != manifest.vocab_size:
        raise GenerationError(f"vocabulary mismatch: target bundle has {manifest.vocab_size} tokens, "
                              f"draft bundle has {draft_manifest.vocab_size}")
    target_where, target_fell = resolve_noted(target_device, strict_devices, bundle_format(manifest, "target"))
    draft_where, draft_fell = resolve_noted(draft_device, strict_devices, bundle_format(draft_manifest, "draft"))
    cores = sorted(available_cores())
    placement = plan(str(target_where), str(draft_where), mode, cores, threads)
    both = placement.worker_cores  # a core each: the target's prompt may also use the draft's (idle) core
    target_budget = WorkerBudget(placement.target_threads, placement.target_cpus, None, both)
    draft_budget = WorkerBudget(placement.draft_threads, placement.draft_cpus, draft_precision)
    target, draft = _in_worker_threads([(bundle, manifest, "target", target_where, strict_devices, target_budget),
                                        (draft_source, draft_manifest, "draft", draft_where, strict_devices,
                                         draft_budget)])
    target.placement = Placement(str(target_device), str(target_where), target_fell)  # as asked, not as resolved
    draft.placement = Placement(str(draft_device), str(draft_where), draft_fell)
    # the draft starts from the target's prompt KV only when it is the target's copy and reads its caches
    draft.same_model_as_target = draft_copies_target(manifest, draft_manifest) and adopts_from(draft, target)
    names = {"model": Path(bundle).name, "target": f"{bundle} ({type(target).__name__})",
             "draft": f"{draft_source} ({type(draft).__name__})", "path": f"{manifest.graph_format} bundle",
             "target_device": target.placement.actual, "draft_device": draft.placement.actual,
             "target_precision": manifest.graph("target_prefix").precision,
             "draft_precision": draft_manifest.graph("draft").precision, "placement": placement.describe()}
    engine = Engine(target, load_tokenizer(Path(bundle), manifest), draft, names, both)
    engine.names["load_time_s"] = round(time.perf_counter() - started, 3)  # every generation's stats carry it
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


def placements_here() -> list[str]:
    """Where `run` (mirror) puts its workers on this machine: the default bundle, and `--target cuda` with a GPU."""
    import torch

    cores = sorted(available_cores())
    lines = [f"run (mirror): {plan('ort:cpu', 'ort:cpu', 'mirror', cores).describe()}"]
    if torch.cuda.device_count():
        lines.append(f"run --target cuda (mirror): {plan('torch:cuda:0', 'ort:cpu', 'mirror', cores).describe()}")
    return lines


def _in_worker_thread(folder, manifest, role, device, strict, budget):
    """Load one model in a short-lived thread pinned like its worker, so backend pools inherit the pin."""
    return _in_worker_threads([(folder, manifest, role, device, strict, budget)])[0]


def _in_worker_threads(jobs: list[tuple]) -> list:
    """`_in_worker_thread` for several models at once (each pinned to its own cores: they load in parallel);
    the first failure is re-raised once all have ended."""
    from mirror_rt.devices.registry import load_model

    results = [{} for _ in jobs]

    def work(result, folder, manifest, role, device, strict, budget):
        try:
            result["model"] = load_model(Path(folder), manifest, role, device, strict, budget)
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    threads = [threading.Thread(target=work, args=(result, *job), name=f"load-{job[2]}")
               for result, job in zip(results, jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if "error" in result:
            raise result["error"]
    return [result["model"] for result in results]


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


def _check_vocabularies(target, draft) -> None:
    t, d = target.model.config.vocab_size, draft.model.config.vocab_size
    if t != d:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {t} tokens, "
                              f"draft {draft.source} has {d}")
    if target.tokenizer.sha256() != draft.tokenizer.sha256():
        warnings.warn("target and draft tokenizer files differ although the vocabulary sizes match; "
                      "token ids are compared directly", stacklevel=3)
