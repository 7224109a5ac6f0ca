"""Bench runners over exported bundles: `ar` on every backend and thread count, `sd`, `mirror`.

`ar` loads the bundle's target once per (backend, threads) pair that can run the bundle's
format on this machine — OpenVINO bundles on OpenVINO; ONNX bundles on ONNX Runtime and on
OpenVINO — with 1 thread and with every core, so the fastest target-only variant is the
baseline. `sd` gives the target every core; `mirror` gives each worker one core;
`mirror-no-lookup` is Mirror on the same engine with the draft's prompt-lookup guesses off.
"""

from __future__ import annotations

import os
from pathlib import Path

from mirror_rt.runtime.bench import EngineRunner

FORMAT_BACKENDS = {"openvino": ("openvino:CPU",), "onnx": ("ort:cpu", "openvino:CPU"), "torch": ("torch:cpu",)}


def bundle_runners(methods: list[str], bundle: str, draft_bundle: str | None = None,
                   draft_precision: str | None = None, log=print) -> list:
    """Runners for the `ar`, `sd` and `mirror` entries of `methods` over `bundle`."""
    from mirror_rt.exporters.manifest import read_manifest

    import mirror_rt

    manifest = read_manifest(bundle, verify=False)
    runners = []
    if "ar" in methods:
        runners += _ar_runners(bundle, manifest, log)
    for mode in ("sd", "mirror"):
        if mode in methods or (mode == "mirror" and "mirror-no-lookup" in methods):
            engine = mirror_rt.load_bundle(bundle, draft_bundle=draft_bundle, mode=mode, verify=False,
                                           draft_precision=draft_precision)
            if mode in methods:
                runners.append(EngineRunner(mode, engine, mode))
            if mode == "mirror" and "mirror-no-lookup" in methods:  # ablation on the same engine
                runners.append(EngineRunner("mirror-no-lookup", engine, mode, draft_lookup=0))
    return runners


def _ar_runners(bundle: str, manifest, log) -> list:
    from mirror_rt.devices.registry import (
        WorkerBudget,
        available_devices,
        is_available,
        load_model,
        load_tokenizer,
        parse_device,
    )
    from mirror_rt.runtime.engine import Engine

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    graph_format = manifest.graph("target_prefix").format
    tokenizer = load_tokenizer(Path(bundle), manifest)
    devices = available_devices()
    runners = []
    for device in FORMAT_BACKENDS.get(graph_format, ()):
        if manifest.kv_layout.get("shared") and not device.startswith("ort:"):
            log(f"bench: ar on {device}: the bundle's shared-KV graphs run on ONNX Runtime only, skipped")
            continue
        if not is_available(parse_device(device), devices):
            log(f"bench: ar on {device}: not available here, skipped")
            continue
        for threads in sorted({1, cores}):
            target = load_model(Path(bundle), manifest, "target", device, True, WorkerBudget(threads))
            backend = device.split(":")[0].replace("openvino", "ov")
            runners.append(EngineRunner(f"ar-{backend}-{threads}t", Engine(target, tokenizer), "ar"))
    return runners
