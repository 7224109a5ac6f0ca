"""The torch engine: the target as a torch module on its device, split at its early exit, and a draft on the CPU (an
int8 copy, the target itself as the oracle, another checkpoint, or a bundle's draft on its resolved device).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.placement import is_accelerator, plan
from mirror_rt.devices.registry import stderr_line, torch_draft_device
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.engine import Engine, GenerationError

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def default_dtype(device: str) -> str:
    """bf16 on CUDA (fp16 where the GPU has no bf16), fp32 elsewhere."""
    import torch

    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def load_torch(options: EngineConfig | None = None, mode: str | None = None, log=stderr_line) -> Engine:
    """A torch engine: the target on `devices.device`, the draft on the CPU (`models.draft_model`: int8 by default,
    `target` for the oracle draft, or a model; `models.draft_bundle`: a bundle's, on `devices.draft`), with
    `models.draft_streams` over it. `mode`: the mode it will mostly run (thread placement; None: Mirror).
    """
    import torch

    from mirror_rt.devices.torch.split import TorchSplitTarget
    from mirror_rt.models.loading import load_checkpoint

    started = time.perf_counter()
    options = options or EngineConfig()
    models, devices, precision = options.models, options.devices, options.precision
    device = devices.device or "cpu"
    dtype = {v: k for k, v in DTYPE_NAMES.items()}.get(precision.dtype, precision.dtype) or default_dtype(device)
    threads = _torch_threads(devices.threads, log)
    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"device '{device}' requested but torch sees no CUDA device")
    target = load_checkpoint(models.model, dtype, models.cache_dir, log)
    folder = None if models.draft_streams else models.draft_bundle or _default_draft(options, device, log)
    if folder is not None:
        manifest, where = _bundle_draft_device(folder, target, devices.draft, devices.strict_devices)
    else:
        manifest, where = None, torch_draft_device(devices.draft, devices.strict_devices)
    placement = plan(f"torch:{device}", where, mode, sorted(available_cores()))
    if threads:  # torch's threads, on the worker's core where it is pinned (they inherit its affinity)
        placement = replace(placement, target_threads=threads,
                            draft_threads=placement.draft_threads if folder is not None else threads)
    if folder is not None:
        draft, names = _bundle_draft(folder, manifest, where, placement, precision.draft_precision)
    else:
        draft, names = _torch_draft(models.draft_model or "int8", models.draft_streams, target, dtype,
                                    models.cache_dir, log)
    names |= {"model": Path(target.source).name, "target": target.source, "target_precision": DTYPE_NAMES[dtype],
              "path": f"torch {'compiled' if precision.compile else 'eager'} ({device})",
              "placement": placement.describe(), "target_device": f"torch:{device}", "draft_device": str(where)}
    split = TorchSplitTarget(target.model, options.split.exit_layer, options.split.kappa, device,
                             compile=bool(precision.compile))
    if precision.compile:  # compiled code is specialized on torch's thread count: warm up at the mode's
        log(f"mirror-rt: compiling the target's windows for {device} (torch.compile, once per process)")
        previous = torch.get_num_threads()
        torch.set_num_threads(placement.target_threads or previous)
        try:
            split.warm_up()
        finally:
            torch.set_num_threads(previous)
    cpus = placement.worker_cores if devices.pin else None
    return Engine(split, target.tokenizer, draft, names, cpus, placement, batch=options.batch,
                  load_time_s=round(time.perf_counter() - started, 3))


def _torch_threads(threads: int | None, log) -> int | None:
    """torch's intra-op threads: `threads`, at most the cores usable here (more only contend), said when capped."""
    cores = len(available_cores())
    if threads and threads > cores:
        log(f"mirror-rt: warning: --threads {threads} is more than the {cores} core{'s' * (cores != 1)} usable "
            f"here; using {cores}")
        return cores
    return threads


def _default_draft(options: EngineConfig, device: str, log):
    """The default bundle's folder when the default model's target runs on an accelerator and no draft is named (its
    ONNX Runtime draft gets every CPU core), else None (the torch int8 draft)."""
    if options.models.draft_model is not None or options.models.model is not None or not is_accelerator(device):
        return None
    from mirror_rt.devices import engines  # the default bundle is the assembly's (engines imports this module)

    return engines.default_bundle_or_none(options.models.cache_dir, log)


def _bundle_draft_device(folder, target, draft_device: str, strict: bool):
    """(manifest, resolved device) of a bundle's draft for a torch target; refuses another vocabulary."""
    from mirror_rt.devices.bundles import bundle_format
    from mirror_rt.devices.registry import resolve
    from mirror_rt.exporters.manifest import read_manifest

    manifest = read_manifest(folder, verify=False)
    if manifest.vocab_size != target.model.config.vocab_size:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {target.model.config.vocab_size} "
                              f"tokens, draft bundle {folder} has {manifest.vocab_size}")
    return manifest, resolve(draft_device, strict, bundle_format(manifest, "draft"))


def _bundle_draft(folder, manifest, where, placement, precision: str | None):
    """A bundle's draft loaded on `where` with the placement's draft share; returns (model, names)."""
    from mirror_rt.devices.bundle_engine import in_worker_thread
    from mirror_rt.devices.bundles import WorkerBudget

    budget = WorkerBudget(placement.draft_threads, placement.draft_cpus, precision)
    draft = in_worker_thread(folder, manifest, "draft", where, True, budget)  # (its KV: its own, it reads the text)
    return draft, {"draft": f"{folder} ({type(draft).__name__})", "draft_precision": manifest.graph("draft").precision}


def _torch_draft(draft_model: str, draft_streams: str | None, target, dtype: str, cache_dir, log):
    """The torch draft on the CPU (None: the target drafts for itself); returns (model, names)."""
    from mirror_rt.devices.torch.backend import TorchModel

    draft = _load_draft(draft_model, target, dtype, cache_dir, log)
    names = {"draft_precision": "int8" if draft_model == "int8" else DTYPE_NAMES[dtype]}
    if draft is not None:
        names["draft"] = "int8 copy of the target" if draft_model == "int8" else str(draft_model)
    model = TorchModel(draft, "cpu") if draft is not None else None
    if draft_streams:
        from mirror_rt.devices.torch.backend import TorchStreamDraft
        from mirror_rt.models.ss_draft import load_streams

        model = TorchStreamDraft(load_streams(draft if draft is not None else target.model, draft_streams), "cpu")
        names["draft"] = f"{names.get('draft', 'target')} + SS streams from {draft_streams}"
    return model, names


def _load_draft(draft_model, target, dtype, cache_dir, log):
    """The draft's torch module, or None for the oracle draft (the target itself)."""
    import warnings

    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.models.quantize import int8_copy

    if draft_model == "target":
        return None
    if draft_model == "int8":
        return int8_copy(target.model)
    draft = load_checkpoint(draft_model, dtype, cache_dir, log)
    t, d = target.model.config.vocab_size, draft.model.config.vocab_size
    if t != d:
        raise GenerationError(f"vocabulary mismatch: target {target.source} has {t} tokens, "
                              f"draft {draft.source} has {d}")
    if target.tokenizer.sha256() != draft.tokenizer.sha256():
        warnings.warn("target and draft tokenizer files differ although the vocabulary sizes match; "
                      "token ids are compared directly", stacklevel=2)
    return draft.model
