"""ONNX Runtime sessions from the bundle's cache of optimized graphs: made once, read back with optimizations
off, the same logits bit for bit, and keyed so that another onnxruntime, other options or a re-exported
graph never read a stale file."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from mirror_rt.exporters.export import export_bundle

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", tmp_path_factory.mktemp("b") / "onnx", fmt="onnx", progress=False)


def _logits(path, ids):
    from mirror_rt.devices.onnxruntime.backend import ORTGraph, ORTModel
    from mirror_rt.models.config import ModelConfig

    config = ModelConfig.from_name("tiny")
    graph = ORTGraph(path, "cpu", (config.n_kv_heads, config.head_dim), threads=1)
    model = ORTModel(graph, config.vocab_size, config.max_seq_len)
    cache = model.new_cache(len(ids) + 4)
    return graph, np.array(model.forward(ids, cache)), np.array(model.forward([7, 9], cache))


def test_second_session_reads_the_cached_graph_and_computes_the_same(bundle):
    from mirror_rt.devices.onnxruntime.backend import session_options
    from mirror_rt.devices.onnxruntime.session import GRAPH_FILE, cache_folder

    draft = bundle / "draft.onnx"
    folder = cache_folder(draft, ["CPUExecutionProvider"], session_options(1))
    ids = [5, 70, 80, 90, 100, 33, 44]
    shutil.rmtree(bundle / ".cache" / "ort", ignore_errors=True)  # sessions made at export time, if any
    fresh, prompt, step = _logits(draft, ids)
    assert fresh.session._model_path == str(draft)
    assert (folder / GRAPH_FILE).is_file() and not list(folder.parent.glob("*.partial-*"))
    cached, prompt_again, step_again = _logits(draft, ids)
    assert cached.session._model_path == str(folder / GRAPH_FILE)
    assert np.array_equal(prompt, prompt_again) and np.array_equal(step, step_again)


def test_key_follows_version_options_and_graph(bundle, monkeypatch):
    from mirror_rt.devices.onnxruntime.backend import session_options
    from mirror_rt.devices.onnxruntime.session import cache_folder

    graph, providers = bundle / "target_exit.onnx", ["CPUExecutionProvider"]
    base = cache_folder(graph, providers, session_options(1))
    assert cache_folder(graph, providers, session_options(2)) == base  # threads optimize nothing differently
    basic = session_options(1)
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert cache_folder(graph, providers, basic) != base
    assert cache_folder(graph, ["OpenVINOExecutionProvider", *providers], session_options(1)) != base
    stat = graph.stat()
    os.utime(graph, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # re-exported in place
    touched = cache_folder(graph, providers, session_options(1))
    monkeypatch.setattr(ort, "__version__", "0.0.1")
    upgraded = cache_folder(graph, providers, session_options(1))
    assert len({base, touched, upgraded}) == 3 and upgraded.parent == base.parent == bundle / ".cache" / "ort"


def test_unwritable_bundle_builds_sessions_without_a_cache(bundle, monkeypatch):
    from mirror_rt.devices.onnxruntime import session as ort_session

    monkeypatch.setattr(ort_session, "_partial_folder", lambda folder: None)
    monkeypatch.setattr(ort_session, "cpu_fingerprint", lambda: "another cpu")
    graph, _, _ = _logits(bundle / "draft.onnx", [5, 6, 7])
    assert graph.session._model_path == str(bundle / "draft.onnx")


def test_a_damaged_cache_is_built_again(bundle):
    """A cached graph damaged from outside (its weights cut short: a full disk, a cut copy) is replaced: the session
    is built from the bundle's graph again, with the same logits."""
    from mirror_rt.devices.onnxruntime.backend import session_options
    from mirror_rt.devices.onnxruntime.session import GRAPH_FILE, WEIGHTS_FILE, cache_folder

    graph = bundle / "draft.onnx"
    ids = [5, 70, 80]
    _, prompt, step = _logits(graph, ids)  # made (or read) the cache
    folder = cache_folder(graph, ["CPUExecutionProvider"], session_options(1))
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    rebuilt, prompt_again, step_again = _logits(graph, ids)
    assert rebuilt.session._model_path == str(graph) and (folder / GRAPH_FILE).is_file()
    assert np.array_equal(prompt, prompt_again) and np.array_equal(step, step_again)
    assert cache_folder(graph, ["CPUExecutionProvider"], session_options(1)) == folder


def test_a_graph_needing_the_native_op_says_why_it_cannot_load(bundle, monkeypatch):
    """A pool-attention graph where mirror-rt's op cannot be built: one line naming the reason and the way out."""
    from mirror_rt.devices.onnxruntime.backend import ORTGraph
    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.manifest import BundleError, read_manifest

    if read_manifest(bundle).kv_layout.get("attention") != "pool":
        pytest.skip("the bundle attends with standard ops (no compiler here)")
    monkeypatch.setattr(native_op, "compiler", lambda: None)
    shutil.rmtree(bundle / ".cache" / "ort", ignore_errors=True)
    with pytest.raises(BundleError, match="no C\\+\\+ compiler.*--attention standard$"):
        ORTGraph(bundle / "target_suffix.onnx", "cpu", (2, 16), threads=1)
