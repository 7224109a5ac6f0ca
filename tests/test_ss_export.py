"""SS drafts through `mirror-rt export --draft-streams`: the ONNX graph equals torch, Mirror stays exact."""

import warnings

import numpy as np
import pytest
import torch
from conftest import decode, load_parts

from mirror_rt.devices.registry import available_devices
from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.exporters.export import ExportError, export_bundle
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.models.ss_draft import StreamDraft
from mirror_rt.runtime.reference import generate
from mirror_rt.training.ss_training import save_checkpoint

pytestmark = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")

PROMPT, WINDOW = [5, 17, 42, 9, 33, 61, 2], [7, 8, 9]


def _streams(folder):
    """A streams folder over the `tiny` preset with random (nonzero) stream weights; returns the torch draft."""
    base = load_checkpoint("tiny", log=lambda *a: None).model
    draft = StreamDraft(base, n_streams=2, n_stream_layers=2, rank=8)
    with torch.no_grad():
        for p in draft.stream_layers.parameters():
            p.normal_(0, 0.3)
        draft.stream_embed.normal_(0, 0.5)
    save_checkpoint(draft, torch.optim.SGD(draft.stream_layers.parameters(), lr=0.1), folder, 1)
    return draft


def _export(folder, streams, weights, kv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", folder, fmt="onnx", draft_weights=weights, kappa=4, progress=False,
                             draft_streams=str(streams), kv=kv)


BUNDLES = [("fp32", "shared"), ("fp32", "explicit"), ("int8", "shared")]


@pytest.fixture(scope="module")
def ss_bundles(tmp_path_factory):
    """(torch SS draft, {(weights, kv): bundle}) over the same streams."""
    root = tmp_path_factory.mktemp("ss")
    draft = _streams(root / "streams")
    return draft, {(w, kv): _export(root / f"{w}-{kv}", root / "streams", w, kv) for w, kv in BUNDLES}


def _assert_streams_equal(draft, torch_draft, atol: float):
    """The backend draft's main and stream logits over PROMPT, then WINDOW, equal torch's; returns torch's main."""
    cache = draft.new_cache(32)
    first, second = draft.forward_streams(PROMPT, cache), draft.forward_streams(WINDOW, cache)
    with torch.no_grad():
        main, streams = torch_draft.forward_streams(torch.tensor(PROMPT + WINDOW), new_cache(torch_draft.base, 32))
    np.testing.assert_allclose(np.concatenate([first[0], second[0]]), main.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(np.concatenate([first[1], second[1]]), streams.numpy(), atol=atol, rtol=0)
    return main


@pytest.mark.parametrize("kv", ["shared", "explicit"])
def test_ss_graph_equals_torch(ss_bundles, kv):
    """Main and stream logits of the fp32 graph equal StreamDraft.forward_streams: prompt, then a window."""
    torch_draft, bundles = ss_bundles
    draft = load_parts(bundles["fp32", kv], "ort:cpu", "ort:cpu", strict=True, threads=1).draft
    assert draft.graph.shared_kv == (kv == "shared")
    assert draft.n_streams == 2
    main = _assert_streams_equal(draft, torch_draft, atol=1e-4)
    prefill = draft.forward_last(PROMPT, draft.new_cache(32))  # last_rows 1: one position's streams
    np.testing.assert_allclose(prefill, main.numpy()[len(PROMPT) - 1:len(PROMPT)], atol=1e-4, rtol=0)


@pytest.mark.skipif(not available_devices()["openvino"], reason="openvino not installed")
def test_openvino_loads_the_explicit_ss_graph(ss_bundles):
    """OpenVINO's CPU plugin runs the explicit-KV SS graph (made stateful at load): the same logits as torch."""
    torch_draft, bundles = ss_bundles
    draft = load_parts(bundles["fp32", "explicit"], "ort:cpu", "openvino:CPU", strict=True, threads=1).draft
    assert type(draft).__name__ == "OVModel" and draft.capabilities.streams and draft.n_streams == 2
    _assert_streams_equal(draft, torch_draft, atol=1e-3)


def test_ss_int8_graph_keeps_stream_weights_fp32(ss_bundles):
    """int8 draft weights quantize the base's products only; the rank-8 stream products stay fp32."""
    import onnx

    from mirror_rt.models.config import ModelConfig

    graph = onnx.load(str(ss_bundles[1]["int8", "shared"] / "draft.onnx")).graph
    weights = {t.name: tuple(t.dims) for t in graph.initializer}
    plain = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]  # constant-weight products
    assert len(plain) == 3 * 2 * 2 and all(8 in weights[n.input[1]] for n in plain)  # (q, v, down) x (a, b) x 2 layers
    n_layers = ModelConfig.from_name("tiny").n_layers
    # every base product once (fused q|k|v and gate|up: 4 per layer; main and stream rows share them), the head
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 4 * n_layers + 1


@pytest.mark.parametrize("weights,kv", BUNDLES)
def test_mirror_with_onnx_ss_draft_equals_reference(ss_bundles, weights, kv):
    """Mirror over the bundle's split target and its SS draft (explicit KV: caches of its own, it reads the text
    itself) gives the target's tokens."""
    loaded = load_parts(ss_bundles[1][weights, kv], "ort:cpu", "ort:cpu", strict=True, threads=1)
    assert loaded.draft.capabilities.streams
    expected = [t for step in generate(loaded.target, PROMPT, 40) for t in step]
    for gamma in (2, 5):
        got = decode(loaded.target, loaded.draft, PROMPT, mode="mirror", max_new_tokens=40, gamma=gamma)
        assert got.tokens == expected


def test_draft_streams_refusals(tmp_path):
    """One-line errors: streams with a non-ONNX format, and a folder that holds no streams."""
    with pytest.raises(ExportError, match="--draft-streams needs --format onnx"):
        export_bundle("tiny", tmp_path / "ov", fmt="openvino", draft_streams=str(tmp_path), progress=False)
    with pytest.raises(ExportError, match="--draft-streams .*streams.json"):
        export_bundle("tiny", tmp_path / "bad", fmt="onnx", draft_streams=str(tmp_path), progress=False)
