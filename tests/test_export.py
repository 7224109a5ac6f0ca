"""export_bundle and the manifest: limits, refusals naming the file, static graphs, the real model.

Logit tolerances: tiny fp32 model atol 1e-4 (see test_devices.py); the real model atol
5e-3 on logits of magnitude ~30: 30 layers of width 576/1536 in fp32 with OpenVINO's own
kernels accumulate ~1e-4 relative error, while a wrong position or KV slot moves logits by >1.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import decode, load_parts

from mirror_rt.devices.registry import available_devices
from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.exporters.exact_kv import GROUPS, GROUPS_INPUT
from mirror_rt.exporters.export import ExportError, export_bundle
from mirror_rt.exporters.manifest import FORMAT_VERSION, BundleError, read_manifest
from mirror_rt.exporters.openvino import int4_group_size
from mirror_rt.models.config import ModelConfig
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.runtime.reference import generate

needs_openvino = pytest.mark.skipif(not available_devices()["openvino"], reason="openvino not installed")
PROMPT = [5, 17, 42, 9, 80, 33, 61, 2, 14, 99, 7]


def _export(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs.setdefault("fmt", "openvino")
        return export_bundle("tiny", path, progress=False, **kwargs)


@pytest.fixture(scope="module")
def torch_bundle(tmp_path_factory):
    """A tiny torch bundle: cheap to copy and break."""
    return _export(tmp_path_factory.mktemp("b") / "torch", fmt="torch", kappa=4)


@pytest.fixture(scope="module")
def static_bundle(tmp_path_factory):
    """A tiny static OpenVINO bundle (window 4, context 48) with an int4 draft."""
    if not available_devices()["openvino"]:
        pytest.skip("openvino not installed")
    return _export(tmp_path_factory.mktemp("b") / "static", static=True, max_context=48, max_window=4,
                   draft_weights="int4", kappa=4)


def test_manifest_describes_the_bundle(torch_bundle):
    """Defaults: exit layer N/2, the four roles, tokenizer hash, versions, kv layout."""
    manifest = read_manifest(torch_bundle)
    assert manifest.format_version == FORMAT_VERSION == 8
    assert manifest.exit_layer == manifest.n_layers // 2 and manifest.kappa == 4
    assert {g.role for g in manifest.graphs} == {"target_prefix", "target_exit", "target_suffix", "draft"}
    exit_graph = manifest.graph("target_exit")  # torch: computed from the target's own weights
    assert exit_graph.file == "target.safetensors" and exit_graph.precision == "fp32"
    assert exit_graph.first_layer == exit_graph.last_layer == manifest.exit_layer
    assert manifest.tokenizer["sha256"] and "torch" in manifest.exporter_versions
    assert manifest.kv_layout["layout"] == "BHTD"


def _copy(bundle, tmp_path):
    return shutil.copytree(bundle, tmp_path / "copy")


@pytest.mark.parametrize("version", [1, 99])
def test_unknown_format_version_refused(torch_bundle, tmp_path, version):
    """A manifest from another format version (1: exit inside the prefix) is refused in one line."""
    folder = _copy(torch_bundle, tmp_path)
    data = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(data | {"format_version": version}))
    with pytest.raises(BundleError, match=rf"manifest\.json.*format version {version} is not supported") as info:
        load_parts(folder)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d | {"tokenizer": None}, "tokenizer must be an object, got null"),
    (lambda d: d | {"kv_layout": "x"}, 'kv_layout must be an object, got "x"'),
    (lambda d: d | {"exit_layer": "2"}, 'exit_layer must be int, got "2"'),
    (lambda d: d | {"target_config": {}}, "target_config is not a model configuration"),
    (lambda d: d | {"graphs": [g | {"files": None} for g in d["graphs"]]}, "files must be an object, got null"),
    (lambda d: d | {"graphs": [g | {"files": {"../../etc/passwd": "0"}} for g in d["graphs"]]},
     "lists ../../etc/passwd, outside the bundle folder"),
    (lambda d: d | {"graphs": [g | {"file": "/etc/passwd"} for g in d["graphs"]]},
     "lists /etc/passwd, outside the bundle folder"),
    (lambda d: d | {"vocab_size": -5}, "vocab_size -5 differs from target_config's"),
    (lambda d: d | {"kappa": 0}, "kappa 0 not in 1.."),
    (lambda d: d | {"max_context": 0}, "max_context must be at least 2"),
], ids=["tokenizer null", "kv_layout a string", "exit_layer a string", "empty target_config", "graph files null",
        "a listed file outside the folder", "a graph file outside the folder", "negative vocabulary", "kappa 0",
        "no context"])
def test_a_hand_edited_manifest_is_refused_in_one_line(torch_bundle, tmp_path, edit, says):
    """A hand-edited manifest fails as one line naming the field, not as an AttributeError in a loader."""
    folder = _copy(torch_bundle, tmp_path)
    data = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(edit(data)))
    with pytest.raises(BundleError, match=re.escape(says)) as info:
        load_parts(folder)
    assert "\n" not in str(info.value)


def test_missing_file_refused(torch_bundle, tmp_path):
    """A graph file listed in the manifest but absent is refused by name."""
    folder = _copy(torch_bundle, tmp_path)
    (folder / "target.safetensors").unlink()
    with pytest.raises(BundleError, match=r"target\.safetensors: missing"):
        load_parts(folder)


def test_corrupt_file_refused(torch_bundle, tmp_path):
    """A graph file whose sha256 changed is refused by name, in one line."""
    folder = _copy(torch_bundle, tmp_path)
    path = folder / "target.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"target\.safetensors: corrupt") as info:
        load_parts(folder)
    assert "\n" not in str(info.value)


def test_unchanged_files_are_hashed_once(torch_bundle, tmp_path, monkeypatch):
    """A second load hashes nothing while files keep their size and mtime; a rewritten file is hashed and refused."""
    from mirror_rt.exporters import manifest

    folder, hashed = _copy(torch_bundle, tmp_path), []
    shutil.rmtree(folder / ".cache", ignore_errors=True)  # the fixture's own stamps, if a test loaded it
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    load_parts(folder)
    first, hashed[:] = len(hashed), []
    load_parts(folder)
    assert first > 0 and hashed == []
    path = folder / "target.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"target\.safetensors: corrupt"):
        load_parts(folder)
    assert hashed == ["target.safetensors"]


def test_missing_manifest_refused(tmp_path):
    """A folder without manifest.json is not a bundle."""
    with pytest.raises(BundleError, match=r"manifest\.json: missing"):
        load_parts(tmp_path)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(exit_layer=0), "--exit-layer"),
    (dict(exit_layer=4), "--exit-layer"),
    (dict(kappa=0), "--kappa"),
    (dict(fmt="tflite"), "--format"),
    (dict(weights="int3"), "--weights"),
    (dict(exit_weights="int4"), "--exit-weights"),
    (dict(static=True, fmt="onnx"), "--static"),
    (dict(static=True, max_context=10_000), "--max-context"),
    (dict(static=True, max_context=32, max_window=65), "--max-window"),
    (dict(max_window=4), "--max-window needs --static"),  # recorded in a dynamic bundle and never read
    (dict(max_context=1), r"--max-context must be in 2\.\."),  # the range said 1.., the manifest then refused 1
])
def test_limits_validated_before_exporting(tmp_path, kwargs, flag):
    """Bad options fail with a message naming the flag, and nothing is written."""
    with pytest.raises(ExportError, match=flag):
        export_bundle("tiny", tmp_path / "out", progress=False, **{"fmt": "openvino", **kwargs})
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_int4_group_size_divides_smollm2_widths():
    """nncf's default group 128 does not divide hidden 576: 64 is picked."""
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
                          n_kv_heads=3)
    assert int4_group_size(smollm2) == 64
    assert int4_group_size(ModelConfig.from_name("tiny")) == 64


@needs_openvino
def test_static_bundle_runs_on_openvino_cpu(static_bundle):
    """Fixed-shape graphs: chunked prefill, padded windows, O(1) rollback, logits equal torch."""
    target, draft, _, manifest = load_parts(static_bundle, "openvino:CPU", "openvino:CPU", strict=True,
                                             threads=1)
    assert manifest.static and manifest.max_window == 4
    model = load_checkpoint("tiny").model
    ids, _ = target.forward_prefix(PROMPT, target.new_cache(48))  # the exit graph pads windows too
    assert ids.shape == (len(PROMPT), 4) and manifest.graph("target_exit").precision == "int8"
    cache = target.new_cache(48)
    logits = target.forward(PROMPT, cache)  # 11 tokens: three windows of 4
    cache.rollback(len(PROMPT) - 2)
    tail = target.forward([3, 4, 5], cache)
    expected = model(torch.tensor(PROMPT[:-2] + [3, 4, 5]), new_cache(model, 48)).numpy()
    np.testing.assert_allclose(logits[:-2], expected[:-3], atol=1e-4, rtol=0)
    np.testing.assert_allclose(tail, expected[-3:], atol=1e-4, rtol=0)
    assert draft.forward(PROMPT, draft.new_cache(48)).shape == (len(PROMPT), manifest.vocab_size)
    tokens = decode(target, draft, PROMPT, max_new_tokens=16, gamma=3).tokens
    assert tokens == [t for step in generate(target, PROMPT, 16) for t in step]


@pytest.fixture(scope="module")
def default_model():
    """The embedded default model, skipped only where it cannot be fetched or found."""
    from mirror_rt.models.default_model import DefaultModelUnavailable

    try:
        return load_checkpoint(None, log=lambda *a: None)
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@needs_openvino
def test_default_bundle_exports_fast_and_matches_torch(default_model, tmp_path):
    """The default bundle exports in < 5 min; its split target equals torch; SD equals AR."""
    start = time.perf_counter()
    folder = export_bundle(None, tmp_path / "default", fmt="openvino", progress=False)
    assert time.perf_counter() - start < 300
    target, draft, tokenizer, manifest = load_parts(folder, "openvino:CPU", "openvino:CPU", strict=True)
    assert manifest.exit_layer == 15 and manifest.graph("draft").precision == "int8"
    assert manifest.graph("target_exit").precision == "int8"
    assert (folder / "openvino_tokenizer.xml").exists()
    prompt = tokenizer.encode("The capital of France is")
    cache = target.new_cache(64)
    ids, _ = target.forward_prefix(prompt, cache)
    logits = target.forward_suffix(cache)
    model = default_model.model
    with torch.inference_mode():
        expected = model(torch.tensor(prompt), new_cache(model, 64)).numpy()
    np.testing.assert_allclose(logits, expected, atol=5e-3, rtol=0)
    assert ids.shape == (len(prompt), 8)
    with torch.inference_mode():
        h = model.run_layers(model.embed(torch.tensor(prompt)), new_cache(model, 64, 0, 15), 0, 15)
        top1 = model.logits(h).argmax(-1).numpy()
    assert np.mean(ids[:, 0] == top1) >= 0.8  # int8 exit: top-1 mostly as fp32
    greedy = [t for step in generate(target, prompt, 12) for t in step]
    assert decode(target, draft, prompt, max_new_tokens=12, gamma=4).tokens == greedy


@pytest.fixture(scope="module")
def onnx_int8_bundle(tmp_path_factory):
    """A tiny ONNX bundle: fp32 target, weight-only int8 draft (MatMulNBits)."""
    if not available_devices()["onnxruntime"]:
        pytest.skip("onnxruntime not installed")
    return _export(tmp_path_factory.mktemp("b") / "onnx8", fmt="onnx", draft_weights="int8", kappa=4)


def test_onnx_int8_draft_is_weight_only(onnx_int8_bundle):
    """Every projection and the LM head are MatMulNBits; no dynamic activation quantization.

    Shared-KV graphs fuse q|k|v and gate|up (4 products per layer) and rotate inside the attention op.
    """
    import onnx

    nodes = onnx.load(str(onnx_int8_bundle / "draft.onnx")).graph.node
    ops = [n.op_type for n in nodes]
    n_layers = ModelConfig.from_name("tiny").n_layers
    assert ops.count("MatMulNBits") == 4 * n_layers + 1
    assert "MatMulInteger" not in ops and "DynamicQuantizeLinear" not in ops
    attention = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert len(attention) == n_layers and "Neg" not in ops and "Transpose" not in ops
    rotary = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("do_rotary") for n in attention]
    assert rotary == [1] * n_layers


def test_onnx_targets_attend_in_place(onnx_int8_bundle):
    """Where mirror-rt's op builds, target prefix and suffix attend through it (exporters.pool_kv: one node a layer
    that stores the call's keys and values into the buffers and reads them in place; no ScatterND, no groups)."""
    import onnx

    from mirror_rt.exporters import native_op

    if not native_op.available():
        pytest.skip("no C++ compiler: the bundle attends with standard ops")
    assert read_manifest(onnx_int8_bundle).kv_layout["attention"] == "pool"
    for role in ("target_prefix", "target_suffix"):
        graph = onnx.load(str(onnx_int8_bundle / f"{role}.onnx")).graph
        ops = [n.op_type for n in graph.node]
        layers = len([i for i in graph.input if i.name.startswith("past_key")])
        assert layers >= 1 and ops.count(native_op.OP) == layers
        assert "Softmax" not in ops and "ScatterND" not in ops and GROUPS_INPUT not in [i.name for i in graph.input]


def test_w8a8_targets_keep_float16_kv(tmp_path):
    """`--weights w8a8` with pool attention: the target's KV buffers are float16 by default (`--kv-dtype`), read by
    PoolAttentionHalf; `--kv-dtype fp16` beside the standard ops is refused in one line before anything loads."""
    import onnx

    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.export import ExportError

    with pytest.raises(ExportError, match="^--kv-dtype fp16 needs --attention pool"):
        _export(tmp_path / "refused", fmt="onnx", kv_dtype="fp16", attention="standard")
    if not native_op.available():
        pytest.skip("no C++ compiler: the bundle attends with standard ops")
    folder = _export(tmp_path / "w8a8", fmt="onnx", weights="w8a8", kappa=4)
    assert read_manifest(folder).kv_layout["dtype"] == "float16"
    graph = onnx.load(str(folder / "target_suffix.onnx")).graph
    past = [i for i in graph.input if i.name.startswith("past_")]
    assert past and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in past)
    assert native_op.OP_HALF in [n.op_type for n in graph.node]
    draft_past = [i for i in onnx.load(str(folder / "draft.onnx")).graph.input if i.name.startswith("past_")]
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in draft_past)


def test_onnx_targets_attend_with_standard_ops(tmp_path):
    """`--attention standard` (and machines without a compiler): target prefix and suffix attend without
    GroupQueryAttention (exporters.exact_kv: the same kernels in every call shape), per group of rows; the draft
    keeps GroupQueryAttention."""
    import onnx

    folder = _export(tmp_path / "standard", fmt="onnx", draft_weights="int8", kappa=4, attention="standard")
    assert read_manifest(folder).kv_layout["attention"] == "standard"
    for role in ("target_prefix", "target_suffix"):
        ops = [n.op_type for n in onnx.load(str(folder / f"{role}.onnx")).graph.node]
        layers = ops.count("ScatterND") // 2
        assert layers >= 1 and "GroupQueryAttention" not in ops and "PoolAttention" not in ops
        assert ops.count("RotaryEmbedding") * GROUPS == ops.count("Softmax") * 2 == 2 * GROUPS * layers  # per group
    assert "GroupQueryAttention" in [n.op_type for n in onnx.load(str(folder / "draft.onnx")).graph.node]


def test_onnx_exit_is_its_own_int8_graph(onnx_int8_bundle):
    """The prefix has no LM head and no TopK; the default exit graph is one int8 head with TopK, no KV."""
    import onnx

    prefix = onnx.load(str(onnx_int8_bundle / "target_prefix.onnx")).graph
    exit_graph = onnx.load(str(onnx_int8_bundle / "target_exit.onnx")).graph
    vocab = ModelConfig.from_name("tiny").vocab_size
    assert prefix.output[0].name == "hidden" and "TopK" not in {n.op_type for n in prefix.node}
    assert not [t for t in prefix.initializer if len(t.dims) == 2 and t.dims[1] == vocab]
    assert [i.name for i in exit_graph.input] == ["hidden"]
    assert [o.name for o in exit_graph.output] == ["exit_ids", "exit_logprobs"]
    ops = [n.op_type for n in exit_graph.node]
    assert ops.count("MatMulNBits") == 1 and "MatMul" not in ops and "TopK" in ops


def test_onnx_int8_draft_agrees_with_fp32(onnx_int8_bundle):
    """The int8 draft picks the fp32 model's greedy token at >= 90% of positions; SD equals AR."""
    target, draft, _, _ = load_parts(onnx_int8_bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    model = load_checkpoint("tiny").model
    tokens = PROMPT + [t for step in generate(target, PROMPT, 32) for t in step]
    with torch.inference_mode():
        expected = model(torch.tensor(tokens), new_cache(model, 64)).argmax(-1).numpy()
    chosen = draft.forward(tokens, draft.new_cache(64)).argmax(-1)
    assert np.mean(chosen == expected) >= 0.9
    speculative = decode(target, draft, PROMPT, max_new_tokens=24, gamma=3).tokens
    assert speculative == [t for step in generate(target, PROMPT, 24) for t in step]


@pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")
@pytest.mark.parametrize("model_type, sizes", [
    ("qwen2", {}), ("qwen3", {}),  # q/k/v biases (fused graph); q/k norms (unfused)
    ("llama", {"num_key_value_heads": 2}),  # multi-head attention: its export failed in TorchScript's peephole pass
    ("llama", {"hidden_size": 24}),  # head size 12: GroupQueryAttention refuses it, so the draft attends as targets
], ids=["qwen2", "qwen3", "mha", "head12"])
def test_shared_kv_graphs_match_torch_with_bias_and_qk_norm(tmp_path, model_type, sizes):
    """Shared-KV ONNX graphs of families with attention biases or q/k norms, multi-head attention or an odd head
    size equal torch: prompt, then a window."""
    from conftest import write_hf_folder

    folder = write_hf_folder(tmp_path / model_type, vocab_size=64, model_type=model_type, seed=3, **sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bundle = export_bundle(str(folder), tmp_path / "bundle", fmt="onnx", kv="shared", draft_weights="fp32",
                               exit_weights="fp32", kappa=4, progress=False)
    reference = load_checkpoint(str(folder)).model
    prompt, window = [5, 17, 42, 9, 33, 61, 2], [7, 8, 9]
    expected = reference(torch.tensor(prompt + window), new_cache(reference, 32)).numpy()
    loaded = load_parts(bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    for model in (loaded.target, loaded.draft):
        cache = model.new_cache(32)
        logits = np.concatenate([model.forward(prompt, cache), model.forward(window, cache)])
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")
def test_q4_1_draft_bundle(tmp_path):
    """--draft-weights q4_1: 4-bit products with a block-minimum correction, an int8 head; SD equals AR."""
    import onnx

    bundle = _export(tmp_path / "q4", fmt="onnx", draft_weights="q4_1", kappa=4)
    assert read_manifest(bundle).graph("draft").precision == "q4_1"
    nodes = onnx.load(str(bundle / "draft.onnx")).graph.node
    bits = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["bits"]
            for n in nodes if n.op_type == "MatMulNBits"]
    n_layers = ModelConfig.from_name("tiny").n_layers
    assert sorted(bits) == [4] * (4 * n_layers) + [8]
    target, draft, _, _ = load_parts(bundle, "ort:cpu", "ort:cpu", strict=True, threads=1)
    speculative = decode(target, draft, PROMPT, max_new_tokens=24, gamma=3).tokens
    assert speculative == [t for step in generate(target, PROMPT, 24) for t in step]


@needs_openvino
def test_a_draft_bundle_of_a_shorter_context_caps_the_context_in_one_line(torch_bundle, static_bundle, capsys):
    """A static draft of 48 positions beside a target of 256: sd crashed with CacheFull (a traceback) once a request
    passed 48. The context is the draft's, said at load; every mode gives ar's text up to it, and a longer prompt
    is refused in one line."""
    import mirror_rt
    from mirror_rt.runtime.engine import GenerationError

    engine = mirror_rt.load_bundle(str(torch_bundle), draft_bundle=str(static_bundle), draft="openvino:CPU")
    assert engine.target.max_seq_len == 48 and "the draft holds 48 positions, the target 256" in capsys.readouterr().err
    texts = {mode: engine.generate(PROMPT, mode=mode, max_new_tokens=100).tokens for mode in ("ar", "sd", "mirror")}
    assert texts["sd"] == texts["ar"] == texts["mirror"] and len(PROMPT) + len(texts["ar"]) <= 48
    with pytest.raises(GenerationError, match="prompt too long: 60 tokens, the model's context is 48"):
        engine.generate(list(range(2, 62)), max_new_tokens=4)
