"""Bench runners: what `mirror-rt bench` runs. Ours run the engine `mirror-rt run` would pick (devices.engines), so
the bench measures what users run; peers run on the target's model folder. `ar` loads the bundle's target on every
backend here that runs its format, at 1 thread and every core (the fastest is the baseline); `ar-bf16` and
`mirror-bf16` run the model as a torch bf16 target, beside GenAI's default bf16.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from mirror_rt.evaluation.bench import EngineRunner, replay_runners
from mirror_rt.evaluation.replay import replay_method
from mirror_rt.runtime.affinity import available_cores

FORMAT_BACKENDS = {"openvino": ("openvino:CPU",), "onnx": ("ort:cpu", "openvino:CPU"), "torch": ("torch:cpu",)}


def bundle_runners(methods: list[str], bundle: str, draft_bundle: str | None = None,
                   draft_precision: str | None = None, log=print, tag: str | None = None) -> list:
    """Runners for the `ar`, `sd` and `mirror` entries of `methods` over `bundle`; with `tag` (a precision) the rows
    are `ar-<tag>-1t`, `sd-<tag>`, `mirror-<tag>`. The speculative engines load first: an `ar` row at their target's
    device and thread count runs on that target's sessions (one load of a 7B, not one per row)."""
    from mirror_rt.devices.bundle_engine import load_bundle
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.exporters.manifest import read_manifest

    manifest = read_manifest(bundle, verify=False)
    runners, engines = [], []
    for mode in ("sd", "mirror"):
        replays = [m for m in methods if (replay_method(m) or ("",))[0] == mode]
        if mode in methods or (mode == "mirror" and "mirror-no-lookup" in methods) or replays:
            options = EngineConfig.from_flags(bundle=bundle, draft_bundle=draft_bundle,
                                               draft_precision=draft_precision)
            engine = load_bundle(options, mode, verify=False)
            engines.append((mode, engine))
            if mode in methods:
                runners.append(EngineRunner(f"{mode}-{tag}" if tag else mode, engine, mode))
            if mode == "mirror" and "mirror-no-lookup" in methods:  # ablation on the same engine
                runners.append(EngineRunner("mirror-no-lookup", engine, mode, draft_lookup=0))
            runners += replay_runners(replays, engine, mode)  # the same target and draft, a decoder of its own
    if "ar" in methods:
        runners = _ar_runners(bundle, manifest, log, tag, engines) + runners
    return runners


def _ar_runners(bundle: str, manifest, log, tag: str | None = None, engines: list = ()) -> list:
    """`ar-<backend>-<threads>t` at 1 thread and every core on each backend that runs the bundle's format. A row
    whose device and threads are those of a loaded engine's target (`engines`: (mode, engine) pairs) runs on that
    target's sessions: an ONNX Runtime session's threads are fixed when it is created, so another count needs
    sessions, and weights, of its own."""
    from mirror_rt.devices.bundles import WorkerBudget, load_model, load_tokenizer
    from mirror_rt.devices.registry import available_devices, is_available, parse_device
    from mirror_rt.runtime.engine import Engine

    cores = len(available_cores())
    graph_format = manifest.graph("target_prefix").format
    tokenizer = load_tokenizer(Path(bundle), manifest)
    devices = available_devices()
    runners = []
    for device in FORMAT_BACKENDS.get(graph_format, ()):
        if manifest.kv_layout.get("shared") and not device.startswith("ort:"):
            if tag is None:  # once, for the main bundle: every precision row's bundle would say it again
                log(f"bench: ar on {device}: the bundle's shared-KV graphs run on ONNX Runtime only, skipped")
            continue
        if not is_available(parse_device(device), devices):
            log(f"bench: ar on {device}: not available here, skipped")
            continue
        for threads in sorted({1, cores}):
            shared = _loaded_target(engines, str(parse_device(device)), threads)
            if shared is None:
                target = load_model(Path(bundle), manifest, "target", device, True, WorkerBudget(threads))
            backend = tag or device.split(":")[0].replace("openvino", "ov")
            names = {"path": f"{graph_format} bundle on {device}, {threads} thread{'s' * (threads > 1)}" +
                     (_shared_sessions(shared, cores) if shared else ""),
                     "target_precision": manifest.graph("target_prefix").precision}
            runners.append(EngineRunner(f"ar-{backend}-{threads}t",
                                        Engine(shared[0] if shared else target, tokenizer, names=names), "ar"))
    return runners


def _shared_sessions(shared: tuple, cores: int) -> str:
    """What an `ar` row on a loaded engine's target (`shared`: target, mode) runs on: its target-only steps take the
    target's sessions over every core where it has them (runtime.batch.steps), whatever its worker's threads."""
    target, mode = shared
    wide = cores > 1 and target.capabilities.wide
    return f" ({mode} engine's target sessions" + ("; its target-only steps on its sessions over every core)" if wide
                                                  else ")")


def _loaded_target(engines, device: str, threads: int):
    """(the target, its engine's mode) of the first (mode, engine) of `engines` whose target runs on `device` at
    `threads` compute threads, or None."""
    for mode, engine in engines:
        placement = engine.placement
        if placement is not None and placement.target == device and placement.target_threads == threads:
            return engine.target, mode
    return None


def bench_runners(methods: list[str], options, log=print) -> list:
    """Runners for `methods`: ours on the engine `run` would pick, peers on the target's folder.

    `options` (devices.options.EngineConfig): torch eager runs when asked for (`models.torch`, or a
    `models.model` / `models.draft_model` with no bundle); then ours share one torch engine. With a bundle
    (given or default), `models.model` only names the peers' target (and the bf16 rows' target).
    `precision.compile`: torch targets run static windows under torch.compile.
    """
    from mirror_rt.devices.engines import default_bundle, model_bundles, streams_model
    from mirror_rt.devices.torch_engine import load_torch
    from mirror_rt.evaluation.bench_llama import METHODS as LLAMA_METHODS
    from mirror_rt.evaluation.bench_llama import find_gguf
    from mirror_rt.evaluation.bench_methods import PRECISION_METHODS, build_runners, check_methods, is_ours
    from mirror_rt.models.loading import resolve_folder

    check_methods(methods)
    models, compile = options.models, bool(options.precision.compile)
    if models.bundle is not None and models.torch:  # as `run` refuses it
        raise ValueError("a bundle runs as exported: --torch runs torch eager (drop one)")
    bundle, model, draft_model, cache_dir = models.bundle, models.model, models.draft_model, models.cache_dir
    draft_bundle = models.draft_bundle
    if bundle is None and not models.torch and draft_model is None and model is None:
        bundle = str(default_bundle(cache_dir, log=log))
    if bundle is None and not models.torch and streams_model(model):  # a GGUF or a model over 1 GB: as `run`
        folders = model_bundles(model, draft_model, cache_dir, options.precision.weights or "auto", log=log)
        bundle, draft_bundle = str(folders[0]), draft_bundle or (str(folders[1]) if folders[1] else None)
        methods = _without(methods, [m for m in methods if m in PRECISION_METHODS or not (
            is_ours(m) or m in LLAMA_METHODS)], "they load the model whole (mirror-rt runs it from its bundle; "
                           "llama-cpp reads the GGUF as it lies)", log)
    gguf = find_gguf(model, cache_dir) if set(methods) & set(LLAMA_METHODS) else None
    if bundle is None:
        engine = load_torch(options, log=log)
        runners = build_runners(methods, engine, engine.names.get("target"), log=log, gguf=gguf)
        runners += precision_runners(methods, model, cache_dir, log)
        return runners + bf16_runners(methods, model, None, draft_model, compile, cache_dir, log)
    if models.bundle is not None and model is None:  # the rows below would run the default model, not --bundle's
        methods = _without(methods, [m for m in methods if m in PRECISION_METHODS or not is_ours(m)],
                           "beside --bundle they would run the default model; --model names the bundle's model for "
                           "them", log)
    elif models.bundle is not None and not [m for m in methods if not is_ours(m) or m in PRECISION_METHODS]:
        log(f"bench: --model {model} names the target of peers and bf16 rows, and none runs: every row runs --bundle")
    ours = [m for m in methods if m in ("ar", "sd", "mirror", "mirror-no-lookup") or replay_method(m) is not None]
    runners = bundle_runners(ours, bundle, draft_bundle, options.precision.draft_precision, log=log)
    runners += precision_runners(methods, model, cache_dir, log)
    runners += bf16_runners(methods, model, models.draft_bundle or bundle, draft_model, compile, cache_dir, log)
    peers = [m for m in methods if not is_ours(m)]
    if peers:
        tokenizer = runners[0].engine.tokenizer if runners else _bundle_tokenizer(bundle)
        folder = model if streams_model(model) or (model and not os.path.exists(model)) else str(
            resolve_folder(model, cache_dir, log=log))
        runners += build_runners(peers, SimpleNamespace(tokenizer=tokenizer), folder, log=log, gguf=gguf)
    return runners


def _without(methods: list[str], dropped: list[str], why: str, log) -> list[str]:
    """`methods` less `dropped`, said in one line."""
    if dropped:
        log(f"bench: skipping {', '.join(dropped)}: {why}")
    return [m for m in methods if m not in dropped]


def precision_runners(methods: list[str], model: str | None, cache_dir: str | None, log) -> list:
    """`ar-<p>`, `sd-<p>`, `mirror-<p>` of `methods`: the default model's bundle with its target at precision p
    (devices.engines.default_bundle exports it once), each row named with p."""
    from mirror_rt.devices.engines import default_bundle
    from mirror_rt.evaluation.bench_methods import BUNDLE_PRECISIONS
    from mirror_rt.models.default_model import DEFAULT_MODEL

    runners = []
    for precision in BUNDLE_PRECISIONS:
        modes = [mode for mode in ("ar", "sd", "mirror") if f"{mode}-{precision}" in methods]
        if not modes:
            continue
        if model not in (None, DEFAULT_MODEL):
            log(f"bench: skipping {', '.join(f'{m}-{precision}' for m in modes)}: precision rows run the default "
                f"model's bundles (for another model: mirror-rt export --weights {precision}, then --bundle)")
            continue
        bundle = str(default_bundle(cache_dir, log=log, weights=precision))
        runners += bundle_runners(modes, bundle, log=log, tag=precision)
    return runners


def bf16_runners(methods: list[str], model: str | None, draft_bundle: str | None, draft_model: str | None,
                 compile: bool, cache_dir: str | None, log) -> list:
    """`ar-bf16` (1 thread and every core) and `mirror-bf16` (a core each; the bundle's draft, else the torch
    draft): `model` as a torch bf16 target, eager unless `compile`; their `-compiled` twins run the same
    target under torch.compile, so eager and compiled rows interleave in one run."""
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.devices.torch_engine import load_torch

    runners, cores = [], len(available_cores())
    for suffix in ("", "-compiled"):
        options = dict(model=model, dtype="bfloat16", compile=compile or bool(suffix), cache_dir=cache_dir)
        if f"ar-bf16{suffix}" in methods:  # no draft: target-only
            engine = load_torch(EngineConfig.from_flags(draft_model="target", **options), "ar", log)
            runners += [EngineRunner(f"ar-bf16{suffix}-{t}t", engine, "ar", threads=t) for t in sorted({1, cores})]
        if f"mirror-bf16{suffix}" in methods:
            bundled = draft_bundle if draft_model is None else None
            engine = load_torch(EngineConfig.from_flags(draft_model=draft_model, draft_bundle=bundled, **options),
                                "mirror", log)
            runners.append(EngineRunner(f"mirror-bf16{suffix}", engine, "mirror"))
    return runners


def _bundle_tokenizer(bundle: str):
    from mirror_rt.devices.bundles import load_tokenizer
    from mirror_rt.exporters.manifest import read_manifest

    return load_tokenizer(Path(bundle), read_manifest(bundle, verify=False))
