"""Device strings, fallback, and bundle backends (torch, OpenVINO CPU, ONNX Runtime CPU) vs torch.

Tiny float32 preset only (the real model is covered in test_export.py). The bundles here
export the exit graph in fp32 so its top-kappa can be compared exactly; the default int8
exit is checked on its own (top-1 agreement, output unchanged). Tolerance for logits: atol
1e-4 on logits of magnitude ~10: every backend computes the same fp32 graph with different
kernels and summation orders; the rounding error of one fp32 dot product of
width <= 128 is ~1e-6 relative, a few layers add a few times that, so 1e-4 leaves a 10x
margin while any real mistake (wrong position, stale KV, wrong layer) moves logits by >0.1.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from conftest import decode, load_parts

from mirror_rt.devices.bundles import WorkerBudget
from mirror_rt.devices.registry import (
    DeviceError,
    DeviceFallbackWarning,
    DeviceSpec,
    available_devices,
    fastest_cpu,
    parse_device,
    resolve,
)
from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.exporters.export import export_bundle
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.runtime.reference import generate

ATOL = 1e-4
KAPPA = 4
PROMPT = [5, 17, 42, 9, 80, 33, 61, 2, 14]
HAVE = available_devices()
# (bundle format, device): every CPU backend installed here
CASES = [("torch", "torch:cpu")]
if HAVE["openvino"]:
    CASES += [("openvino", "openvino:CPU"), ("onnx", "openvino:CPU")]
if HAVE["onnxruntime"]:
    CASES += [("onnx", "ort:cpu"), ("onnx-shared", "ort:cpu")]  # explicit KV, and KV in shared buffers
GRAPH_CASES = [case for case in CASES if case[0] != "torch"]  # bundles with an exit graph


def _flat(steps):
    return [t for step in steps for t in step]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Tiny bundles, one per format (draft: the target itself, int8 where the format has it; exit fp32)."""
    root = tmp_path_factory.mktemp("bundles")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {fmt: export_bundle("tiny", root / fmt, fmt=fmt.split("-")[0], kappa=KAPPA, exit_weights="fp32",
                                   kv="shared" if fmt.endswith("-shared") else "explicit", progress=False)
                for fmt in {fmt for fmt, _ in CASES}}


@pytest.fixture(scope="module")
def int8_exit_bundles(tmp_path_factory):
    """Tiny bundles with the default (int8) exit graph, one per graph format."""
    root = tmp_path_factory.mktemp("int8_exit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {fmt: export_bundle("tiny", root / fmt, fmt=fmt.split("-")[0], kappa=KAPPA, progress=False,
                                   kv="shared" if fmt.endswith("-shared") else "explicit")
                for fmt in {fmt for fmt, _ in GRAPH_CASES}}


@pytest.fixture(scope="module")
def reference():
    """The unsplit torch model the bundles were exported from."""
    return load_checkpoint("tiny").model


def _load(bundles, fmt, device):
    return load_parts(bundles[fmt], device, device, strict=True, threads=1)


@pytest.mark.parametrize("text,expected", [
    ("cpu", DeviceSpec("auto", "cpu")),
    ("cuda", DeviceSpec("auto", "cuda")),
    ("cuda:1", DeviceSpec("auto", "cuda", 1)),
    ("npu", DeviceSpec("auto", "npu")),
    ("gpu", DeviceSpec("auto", "gpu")),
    ("openvino:NPU", DeviceSpec("openvino", "NPU")),
    ("openvino:cpu", DeviceSpec("openvino", "CPU")),
    ("ort:qnn", DeviceSpec("onnxruntime", "qnn")),
    ("onnxruntime:CPU", DeviceSpec("onnxruntime", "cpu")),
    ("torch:cuda:0", DeviceSpec("torch", "cuda", 0)),
    ("torch", DeviceSpec("torch", "cpu")),
])
def test_parse_device(text, expected):
    """Device strings parse into one DeviceSpec form."""
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["tpu", "", "cuda:x", "torch:cuda:0:1"])
def test_parse_device_rejects_unknown(text):
    """Unknown device strings raise DeviceError."""
    with pytest.raises(DeviceError):
        parse_device(text)


CPU_ONLY = {"torch": ["cpu"], "openvino": ["CPU"], "onnxruntime": ["cpu"]}


def test_fallback_warns_once_naming_both():
    """A missing device falls back to a CPU backend that runs the format, with a one-line warning."""
    with pytest.warns(DeviceFallbackWarning) as record:
        spec = resolve("cuda", graph_format="openvino", devices=CPU_ONLY)
    assert spec == DeviceSpec("openvino", "CPU")
    message = str(record[0].message)
    assert "cuda" in message and "openvino:CPU" in message and "\n" not in message


def test_strict_refuses_missing_device():
    """--strict-devices turns the fallback into a DeviceError."""
    with pytest.raises(DeviceError, match="npu"):
        resolve("npu", strict=True, graph_format="onnx", devices=CPU_ONLY)


def test_bare_cpu_picks_a_backend_for_the_format_without_warning():
    """`cpu` is not a fallback: it picks the fastest CPU backend that runs the bundle."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("cpu", graph_format="torch", devices=CPU_ONLY) == DeviceSpec("torch", "cpu")
        assert resolve("cpu", graph_format="onnx", devices=CPU_ONLY).backend == "onnxruntime"


def test_load_bundle_falls_back_and_strict_fails(bundles):
    """load_bundle with absent devices warns and runs; strict raises."""
    fmt = CASES[-1][0]
    if HAVE["torch"][1:] or "NPU" in HAVE["openvino"]:
        pytest.skip("this machine has an accelerator")
    from mirror_rt import load_bundle

    with pytest.warns(DeviceFallbackWarning):
        engine = load_bundle(str(bundles[fmt]), target="cuda", draft="npu", threads=1, mode="ar")
    target, placement = engine.target, engine.placement
    assert target.forward([3, 4], target.new_cache(8)).shape == (2, target.vocab_size)
    assert placement.fallbacks == {"target": "cuda", "draft": "npu"}  # as asked, each fell back
    assert placement.target == placement.draft == str(fastest_cpu(fmt))
    with pytest.raises(DeviceError):
        load_parts(bundles[fmt], "cuda", "npu", strict=True)


@pytest.mark.parametrize("fmt,device", CASES)
def test_split_logits_match_unsplit_torch(bundles, reference, fmt, device):
    """prefix + suffix logits equal the unsplit torch model, prompt then one decode window."""
    target = _load(bundles, fmt, device).target
    cache = target.new_cache(64)
    target.forward_prefix(PROMPT, cache)
    first = target.forward_suffix(cache)
    second = target.forward([7, 8, 9], cache)
    expected = reference(torch.tensor(PROMPT + [7, 8, 9]), new_cache(reference, 64)).numpy()
    np.testing.assert_allclose(np.concatenate([first, second]), expected, atol=ATOL, rtol=0)
    assert cache.length == len(PROMPT) + 3


@pytest.mark.parametrize("fmt,device", CASES)
def test_early_exit_topk_matches_torch(bundles, reference, fmt, device):
    """The fp32 exit graph's top-kappa equals torch's at the exit layer (ids exactly)."""
    target, _, _, manifest = _load(bundles, fmt, device)
    ids, logprobs = target.forward_prefix(PROMPT, target.new_cache(64))
    top = _exit_topk(reference, PROMPT, manifest.exit_layer)
    assert ids.shape == logprobs.shape == (len(PROMPT), KAPPA)
    np.testing.assert_array_equal(ids, top.indices.numpy())
    np.testing.assert_allclose(logprobs, top.values.numpy(), atol=ATOL, rtol=0)


def _exit_topk(reference, tokens, exit_layer: int) -> torch.return_types.topk:
    """Torch's early-exit top-kappa at `exit_layer` (final norm + LM head on the exit hidden state)."""
    with torch.inference_mode():
        cache = new_cache(reference, 64, 0, exit_layer)
        h = reference.run_layers(reference.embed(torch.tensor(tokens)), cache, 0, exit_layer)
        return torch.topk(torch.log_softmax(reference.logits(h), -1), KAPPA, dim=-1)


@pytest.mark.parametrize("fmt,device", GRAPH_CASES)
def test_int8_exit_top1_agrees_with_torch(int8_exit_bundles, reference, fmt, device):
    """The default int8 exit graph picks torch's exit top-1 at >= 90% of positions; logits stay exact."""
    target, _, _, manifest = load_parts(int8_exit_bundles[fmt], device, device, strict=True, threads=1)
    assert manifest.graph("target_exit").precision == "int8"
    assert manifest.graph("target_prefix").precision == "fp32"
    tokens = PROMPT + _flat(generate(target, PROMPT, 40))
    cache = target.new_cache(64)
    ids, _ = target.forward_prefix(tokens, cache)
    logits = target.forward_suffix(cache)
    top = _exit_topk(reference, tokens, manifest.exit_layer)
    assert np.mean(ids[:, 0] == top.indices[:, 0].numpy()) >= 0.9
    expected = reference(torch.tensor(tokens), new_cache(reference, 64)).numpy()
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt,device", GRAPH_CASES)
def test_forward_does_not_run_the_exit_graph(bundles, fmt, device):
    """forward and forward_prefix_only skip the exit graph; forward_prefix runs it once; logits agree."""
    target = _load(bundles, fmt, device).target
    calls = []
    run = target.exit.run
    target.exit.run = lambda *args: calls.append(1) or run(*args)
    plain = target.forward(PROMPT, target.new_cache(64))
    assert calls == []
    cache = target.new_cache(64)
    assert target.forward_prefix_only(PROMPT, cache) is None
    np.testing.assert_array_equal(target.forward_suffix(cache), plain)
    assert calls == []
    target.forward_prefix(PROMPT, target.new_cache(64))
    assert calls == [1]


@pytest.mark.parametrize("fmt,device", GRAPH_CASES)
def test_mirror_with_int8_exit_equals_reference(int8_exit_bundles, fmt, device):
    """Mirror over a bundle with the int8 exit yields exactly the target's greedy tokens."""
    target, draft, _, _ = load_parts(int8_exit_bundles[fmt], device, device, strict=True, threads=1)
    expected = _flat(generate(target, PROMPT, 24))
    assert decode(target, draft, PROMPT, mode="mirror", max_new_tokens=24, gamma=3).tokens == expected


@pytest.mark.parametrize("fmt,device", CASES)
def test_rollback_then_refeed_equals_fresh_prefill(bundles, fmt, device):
    """Rolled-back positions are forgotten in every graph (target prefix, suffix, and draft).

    The draft keeps none of the rejected window and is compared chunk for chunk: ONNX int8
    graphs quantize activations per call, so their numerics depend on the window's rows.
    """
    target, draft, _, _ = _load(bundles, fmt, device)
    for model, kept in ((target, [11]), (draft, [])):
        cache = model.new_cache(64)
        model.forward(PROMPT, cache)
        model.forward([11, 12, 13, 14], cache)
        cache.rollback(len(PROMPT) + len(kept))
        again = model.forward([20, 21], cache)
        fresh_cache = model.new_cache(64)
        model.forward(PROMPT, fresh_cache)
        fresh = model.forward(kept + [20, 21], fresh_cache)[-2:]
        np.testing.assert_allclose(again, fresh, atol=ATOL, rtol=0)
        assert cache.length == fresh_cache.length == len(PROMPT) + len(kept) + 2


@pytest.mark.parametrize("fmt,device", CASES)
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_greedy_equals_reference(bundles, fmt, device, gamma):
    """Speculative decoding with bundle models yields exactly the target's greedy tokens."""
    target, draft, _, _ = _load(bundles, fmt, device)
    expected = [t for step in generate(target, PROMPT, 24) for t in step]
    assert decode(target, draft, PROMPT, max_new_tokens=24, gamma=gamma).tokens == expected


def test_worker_budget_pins_only_the_calling_thread():
    """WorkerBudget.apply pins the worker thread; the main thread keeps its cores (Linux)."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    before = os.sched_getaffinity(0)
    seen = {}

    def worker():
        WorkerBudget(threads=1, cpus=(min(before),)).apply()
        seen["worker"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == {min(before)}
    assert os.sched_getaffinity(0) == before


def test_providers_no_bundle_can_run_on_are_not_listed(monkeypatch):
    """`devices` listed ort:AzureExecutionProvider (a remote-inference provider) that `run` then refused."""
    ort = pytest.importorskip("onnxruntime")
    from mirror_rt.devices.registry import _onnxruntime_devices

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["AzureExecutionProvider", "CPUExecutionProvider"])
    assert _onnxruntime_devices() == ["cpu"]
