"""The draft starting from the target's KV (its pool row takes the target's), and the target's prefill pipelined
over two cores."""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import replace

import numpy as np
import pytest
from conftest import decode, flat, load_parts, perturbed_copy, tiny_target

from mirror_rt.devices.registry import DeviceError, available_devices
from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.exporters.export import export_bundle
from mirror_rt.exporters.manifest import read_manifest
from mirror_rt.runtime.affinity import available_cores, pin, restore
from mirror_rt.runtime.reference import generate

PROMPT = [5, 17, 42, 9, 80, 33, 61, 2, 14, 7, 7, 19, 3]
needs_ort = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")


@pytest.fixture(scope="module", params=["explicit", "shared"])
def onnx_bundle(request, tmp_path_factory):
    """Tiny ONNX bundles (explicit and shared KV) whose draft is the target in fp32 (so adopted KV must
    match the draft's own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", tmp_path_factory.mktemp("kv") / request.param, fmt="onnx",
                             draft_weights="fp32", kv=request.param, progress=False)


@contextlib.contextmanager
def on_one_core():
    """The calling thread pinned to one core: the pipelined prefill's case (an unpinned thread's products share their
    rows out over its cores, and its prompt runs straight through)."""
    previous = pin(min(available_cores()))
    try:
        yield
    finally:
        restore(previous)


@needs_ort
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_pipelined_prefill_equals_forward(onnx_bundle, chunk):
    target, _, _, _ = load_parts(onnx_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    plain_cache, piped_cache = target.new_cache(64), target.new_cache(64)
    plain = target.forward(PROMPT, plain_cache)
    with on_one_core():
        piped = target.prefill_pipelined(PROMPT, piped_cache, cpu=None, chunk=chunk)
    np.testing.assert_allclose(piped[-1], plain[-1], atol=1e-5, rtol=0)
    assert piped_cache.length == plain_cache.length == len(PROMPT) and piped_cache.hidden is None
    np.testing.assert_allclose(target.forward([11, 12], piped_cache), target.forward([11, 12], plain_cache),
                               atol=1e-5, rtol=0)
    assert not [t for t in threading.enumerate() if t.name == "mirror-prefill"]


@needs_ort
def test_an_unpinned_prompt_runs_straight_through(onnx_bundle, monkeypatch):
    """A thread on several cores runs the prompt's halves one after the other (its products split over its cores):
    no pipeline helper, the same logits and cache as `forward`."""
    if len(available_cores()) < 2:
        pytest.skip("needs two cores")
    target, _, _, _ = load_parts(onnx_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    monkeypatch.setattr(target, "_suffix_chunks", lambda *args: pytest.fail("the pipeline ran"))
    plain_cache, straight_cache = target.new_cache(64), target.new_cache(64)
    plain = target.forward(PROMPT, plain_cache)
    straight = target.prefill_pipelined(PROMPT, straight_cache, cpu=None, chunk=4)
    np.testing.assert_allclose(straight[-1], plain[-1], atol=1e-5, rtol=0)
    assert straight_cache.length == len(PROMPT) and straight_cache.hidden is None


@needs_ort
def test_prefill_over_prompt_sessions_equals_forward(onnx_bundle):
    """A target loaded with prompt cores runs the prompt through its wider sessions, to the same cache."""
    import os

    from mirror_rt.devices.bundles import WorkerBudget, load_model

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores and Linux affinity")
    before = os.sched_getaffinity(0)
    cores = tuple(sorted(before))[:2]
    manifest = read_manifest(onnx_bundle)
    wide = load_model(onnx_bundle, manifest, "target", "ort:cpu", True, WorkerBudget(1, None, None, cores))
    assert os.sched_getaffinity(0) == before  # the caller's pin is restored
    plain = load_model(onnx_bundle, manifest, "target", "ort:cpu", True, WorkerBudget(1))
    assert wide.prompt_graphs is not None and plain.prompt_graphs is None
    wide_cache, plain_cache = wide.new_cache(64), plain.new_cache(64)
    expected = plain.forward(PROMPT, plain_cache)[-1:]
    np.testing.assert_allclose(wide.prefill_pipelined(PROMPT, wide_cache, cpu=cores[-1]), expected, atol=1e-5, rtol=0)
    assert wide_cache.length == len(PROMPT) and wide_cache.hidden is None
    np.testing.assert_allclose(wide.forward([11, 12], wide_cache), plain.forward([11, 12], plain_cache),
                               atol=1e-5, rtol=0)


@needs_ort
def test_prompt_sessions_only_when_a_second_copy_fits(onnx_bundle, monkeypatch, tmp_path):
    """No second pair of sessions where the weights would take over a quarter of the free memory."""
    import os

    from mirror_rt.devices import bundles

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores and Linux affinity")
    small = tmp_path / "w"
    small.write_bytes(b"0" * 1024)
    if os.path.exists("/proc/meminfo"):
        assert bundles._second_copy_fits([small]) and not bundles._second_copy_fits([small], share=0.0)
    monkeypatch.setattr(bundles, "_second_copy_fits", lambda paths, loading=(): False)
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    target = bundles.load_model(onnx_bundle, read_manifest(onnx_bundle), "target", "ort:cpu", True,
                                bundles.WorkerBudget(1, None, None, cores))
    assert target.prompt_graphs is None
    plain = target.forward(PROMPT, target.new_cache(64))[-1:]
    np.testing.assert_allclose(target.prefill_pipelined(PROMPT, target.new_cache(64), cpu=None), plain,
                               atol=1e-5, rtol=0)


@needs_ort
def test_pipelined_prefill_reraises_suffix_errors(onnx_bundle, monkeypatch):
    target, _, _, _ = load_parts(onnx_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)

    def broken(*args, **kwargs):
        raise RuntimeError("suffix exploded")

    monkeypatch.setattr(target.suffix, "run", broken)
    with pytest.raises(RuntimeError, match="suffix exploded"), on_one_core():
        target.prefill_pipelined(PROMPT, target.new_cache(64), cpu=None, chunk=2)
    assert not [t for t in threading.enumerate() if t.name == "mirror-prefill"]


@needs_ort
def test_adopted_kv_equals_the_drafts_own_prefill(onnx_bundle):
    """All layers land in order: an fp32 self-draft's pool row over the target's KV computes what its own prefill
    gives. Explicit-KV graphs take no rows: their draft reads the text itself."""
    target, draft, _, manifest = load_parts(onnx_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    assert manifest.draft_of_target and draft.capabilities.reads_target_rows == target.capabilities.rows
    if not target.capabilities.rows:
        assert onnx_bundle.name == "explicit" and not draft.capabilities.rows
        return
    target_pool, draft_pool = target.new_pool(2, 64), draft.new_pool(2, 64)
    target.forward(PROMPT, target_pool.row_cache(1))
    draft_pool.copy_from(0, target_pool, 1, len(PROMPT))
    adopted, own = draft_pool.row_cache(0), draft.new_cache(64)
    draft.forward(PROMPT, own)
    assert adopted.length == len(PROMPT)
    np.testing.assert_allclose(draft.forward([11, 12], adopted), draft.forward([11, 12], own), atol=1e-4, rtol=0)


@needs_ort
@pytest.mark.parametrize("mode", ["mirror", "sd"])
def test_decoding_with_adopted_kv_equals_reference(onnx_bundle, monkeypatch, mode):
    """Mirror and vanilla SD start a draft that is the target's copy from the target's KV: one copy of the prompt's
    positions into its pool row at the first speculative step, then only single positions it never fed (explicit KV:
    no rows, the draft reads the text)."""
    target, draft, _, _ = load_parts(onnx_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    calls = []
    if target.capabilities.rows:
        pool = type(target.new_pool(1, 8))
        copy_from = pool.copy_from
        monkeypatch.setattr(pool, "copy_from", lambda self, row, source, source_row, n, start=0: calls.append(
            (start, n)) or copy_from(self, row, source, source_row, n, start))
    expected = flat(generate(target, PROMPT, 30))
    assert decode(target, draft, PROMPT, mode=mode, max_new_tokens=30, gamma=3).tokens == expected
    if not target.capabilities.rows:
        assert calls == []
        return
    assert calls[0] == (0, len(PROMPT))  # the prompt, at the first speculative step
    # later, only a window's last token where the whole window was accepted (its draft never fed it): sd only
    assert all(n == start + 1 for start, n in calls[1:]) and (mode == "sd" or len(calls) == 1)


@pytest.mark.parametrize("mode", ["mirror", "sd"])
def test_torch_draft_adopts_and_output_is_unchanged(mode):
    """Adoption only moves the draft's guesses (here a perturbed copy told it is the target): same output."""
    target = tiny_target(seed=21)
    expected = flat(generate(TorchModel(target), PROMPT, 40))
    for reads in (True, False):
        draft = TorchModel(perturbed_copy(target, noise=0.3, seed=22))
        draft.capabilities = replace(draft.capabilities, reads_target_rows=reads)
        got = decode(TorchSplitTarget(target), draft, PROMPT, mode=mode, max_new_tokens=40, gamma=4)
        assert got.tokens == expected


def test_adopt_refuses_another_shape():
    import dataclasses

    import torch

    from mirror_rt.models.transformer import random_model

    model = tiny_target(seed=1)
    target = TorchSplitTarget(model)
    shallower = TorchModel(random_model(dataclasses.replace(model.config, n_layers=1), seed=2, dtype=torch.float64))
    pool = target.new_pool(1, 32)
    target.forward(PROMPT, pool.row_cache(0))
    with pytest.raises(ValueError, match="another shape"):
        shallower.new_pool(1, 32).copy_from(0, pool, 0, len(PROMPT))


@pytest.fixture(scope="module")
def ov_bundle(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", tmp_path_factory.mktemp("kv") / "ov", fmt="openvino", progress=False)


LAST_CASES = [("onnx", "ort:cpu")] if available_devices()["onnxruntime"] else []
if available_devices()["openvino"]:
    LAST_CASES += [("onnx", "openvino:CPU"), ("openvino", "openvino:CPU")]


@pytest.mark.parametrize("fmt,device", LAST_CASES)
def test_forward_last_equals_the_last_row_of_forward(onnx_bundle, ov_bundle, fmt, device):
    """Prefill computes the LM head for the last position only, with the same logits and cache."""
    folder = onnx_bundle if fmt == "onnx" else ov_bundle
    if read_manifest(folder).kv_layout.get("shared") and not device.startswith("ort:"):
        with pytest.raises(DeviceError, match="shared buffers .* only ONNX Runtime runs"):
            load_parts(folder, device, device, strict=True, threads=1)
        return
    target, draft, _, _ = load_parts(folder, device, device, strict=True, threads=1)
    assert target.suffix.takes_last_rows and draft.graph.takes_last_rows and not target.prefix.takes_last_rows
    for model in (target, draft):
        full_cache, last_cache = model.new_cache(64), model.new_cache(64)
        full = model.forward(PROMPT, full_cache)
        last = model.forward_last(PROMPT, last_cache)
        assert full.shape[0] == len(PROMPT) and last.shape[0] == 1
        np.testing.assert_allclose(last[0], full[-1], atol=1e-5, rtol=0)
        np.testing.assert_allclose(model.forward([11, 12], last_cache), model.forward([11, 12], full_cache),
                                   atol=1e-5, rtol=0)
