"""Draft vocabulary pruning (training.vocab_prune, models.pruned_head): a vocabulary-pruned draft maps ids back
exactly, in torch, in exported ONNX / OpenVINO draft graphs, and Mirror over it still equals the reference decoder."""

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import decode, flat, load_parts

from mirror_rt.devices.registry import available_devices
from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.exporters.export import ExportError, export_bundle
from mirror_rt.exporters.manifest import BundleManifest, read_manifest
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.models.pruned_head import PrunedHeadDraft, load_kept, save_kept
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.sampling import SamplingConfig, probabilities
from mirror_rt.training.vocab_prune import choose_kept, coverage, token_counts

PROMPT, WINDOW = [5, 17, 42, 9, 33, 61, 2], [7, 8, 9]
VOCAB = 258  # the tiny preset
SIZE = 100  # no other product of the tiny model has 100 columns: the exporter finds the head by its width
onnx_only = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")



@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint("tiny", log=lambda *a: None).model


@pytest.fixture(scope="module")
def kept(tiny):
    """SIZE ids: the first 10 tokens of the target's greedy answer by count, end id 1, then low ids.

    Some later answer tokens are left out, so a pruned draft must miss them (checked where it matters).
    """
    answer = flat(generate(TorchModel(tiny), PROMPT, 40))
    return choose_kept(token_counts([answer[:10]], VOCAB), SIZE, always=(1,))


def _kept_file(folder, kept, vocab_size=VOCAB):
    return str(save_kept(folder / "kept.json", kept, vocab_size, source="test"))


def _export(folder, kept_path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", folder, kappa=4, progress=False, draft_vocab=kept_path, **options)


def test_choose_kept_by_count_then_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 9, 1, 0])
    assert choose_kept(counts, 3).tolist() == [1, 3, 5]  # 9, then the tie at 5 both
    assert choose_kept(counts, 2).tolist() == [1, 5]  # tie at 5: the lower id
    assert choose_kept(counts, 6).tolist() == [0, 1, 2, 3, 5, 6]  # unseen ids by ascending id
    assert choose_kept(counts, 3, always=(7, 4)).tolist() == [4, 5, 7]
    assert choose_kept(torch.zeros(5, dtype=torch.long), 2).tolist() == [0, 1]
    assert choose_kept(counts, 8).tolist() == list(range(8))


@pytest.mark.parametrize("size,always,message", [(0, (), "size must be in 1..8"), (9, (), "size must be in 1..8"),
                                                 (1, (2, 3), "smaller than the 2 ids"),
                                                 (3, (8,), "must be in 0..7")])
def test_choose_kept_refuses_bad_requests(size, always, message):
    with pytest.raises(ValueError, match=message):
        choose_kept(torch.ones(8, dtype=torch.long), size, always)


def test_token_counts_and_coverage():
    assert token_counts([[1, 1, 3], [], [3, 4]], 5).tolist() == [0, 2, 0, 2, 1]
    share, n = coverage(torch.tensor([1, 3]), [([9, 9, 1, 3, 4, 1], 2)], 10)  # answer: 1 3 4 1
    assert (share, n) == (0.75, 4)


def test_load_kept_checks_the_file(tmp_path):
    path = _kept_file(tmp_path, torch.tensor([1, 4, 7]), vocab_size=10)
    assert load_kept(path, 10).tolist() == [1, 4, 7]
    bad = tmp_path / "bad.json"
    cases = [({"vocab_size": 10, "kept": [4, 1]}, "sorted ascending"), ({"vocab_size": 10, "kept": [1, 1]}, "repeats"),
             ({"vocab_size": 10, "kept": [1, 10]}, r"in 0\.\.9"), ({"vocab_size": 10, "kept": []}, "non-empty"),
             ({"vocab_size": 10, "kept": [1.5]}, "token ids"), ({"kept": [1]}, "vocabulary of None")]
    for data, message in cases:
        bad.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_kept(bad, 10)
    with pytest.raises(ValueError, match="vocabulary of 10 tokens, the model has 12"):
        load_kept(path, 12)
    with pytest.raises(ValueError, match="not found"):
        load_kept(tmp_path / "missing.json", 10)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a vocabulary file"):
        load_kept(bad, 10)


def _hidden(model, tokens):
    return model.run_layers(model.embed(torch.tensor(tokens)), new_cache(model, 32))


@torch.no_grad()
def test_pruned_draft_maps_ids_back_exactly(tiny, kept):
    """argmax = kept[argmax of the pruned logits]; kept logits = the full model's; -inf (probability 0) elsewhere."""
    draft = PrunedHeadDraft(tiny, kept)
    assert draft.head_size == SIZE and draft.embed_tokens is tiny.embed_tokens
    assert draft.head.weight.data_ptr() != tiny.lm_head.weight.data_ptr()  # its own copy of the kept rows
    h = _hidden(tiny, PROMPT + WINDOW)
    full, pruned, mapped = tiny.logits(h), draft.pruned_logits(h), draft.logits(h)
    assert mapped.shape == full.shape == (len(PROMPT + WINDOW), VOCAB)
    assert torch.equal(mapped.argmax(-1), kept[pruned.argmax(-1)])
    assert torch.equal(mapped.argmax(-1), kept[full[:, kept].argmax(-1)])
    torch.testing.assert_close(mapped[:, kept], full[:, kept], atol=1e-5, rtol=0)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(mapped[:, outside]).all()
    p = probabilities(mapped.numpy(), SamplingConfig(temperature=0.8, top_k=50, top_p=0.9))
    assert np.isfinite(p).all() and (p[:, outside.numpy()] == 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0)
    stepped = draft.forward(torch.tensor(PROMPT), new_cache(draft, 32))  # the decoder's entry point
    torch.testing.assert_close(stepped, mapped[:len(PROMPT)])


def test_torch_mirror_with_pruned_draft_equals_reference(tiny, kept):
    expected = flat(generate(TorchModel(tiny), PROMPT, 40))
    assert set(expected) - set(kept.tolist())  # the draft cannot propose every target token
    draft = TorchModel(PrunedHeadDraft(tiny, kept))
    for gamma in (1, 4):
        got = decode(TorchSplitTarget(tiny, kappa=4), draft, PROMPT, mode="mirror", max_new_tokens=40, gamma=gamma)
        assert got.tokens == expected


BUNDLES = [{"draft_weights": "fp32"}, {"draft_weights": "int8"}, {"draft_weights": "q4_1"},
           {"draft_weights": "fp32", "kv": "explicit"}]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, kept):
    """{name: ONNX bundle whose draft has the pruned head}."""
    root = tmp_path_factory.mktemp("vocab")
    path = _kept_file(root, kept)
    return {"-".join(o.values()): _export(root / "-".join(o.values()), path, fmt="onnx", **o) for o in BUNDLES}


def _torch_logits(tiny, kept, tokens):
    with torch.no_grad():
        return PrunedHeadDraft(tiny, kept).forward(torch.tensor(tokens), new_cache(tiny, 32)).numpy()


def _prompt_then_window(draft):
    cache = draft.new_cache(32)
    return np.concatenate([draft.forward(PROMPT, cache), draft.forward(WINDOW, cache)])


@onnx_only
@pytest.mark.parametrize("name", ["fp32", "int8", "q4_1", "fp32-explicit"])
def test_onnx_draft_graph_equals_torch(bundles, tiny, kept, name):
    """fp32: the graph's logits equal PrunedHeadDraft's (-inf at the same ids); quantized: argmax always kept."""
    draft = load_parts(bundles[name], "ort:cpu", "ort:cpu", strict=True, threads=1).draft
    got = _prompt_then_window(draft)
    expected = _torch_logits(tiny, kept, PROMPT + WINDOW)
    assert got.shape == expected.shape
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))  # exactly the ids not kept
    if name.startswith("fp32"):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.isin(got.argmax(-1), kept.numpy()).all()
    prefill = draft.forward_last(PROMPT, draft.new_cache(32))
    assert prefill.shape == (1, VOCAB) and np.isin(prefill.argmax(-1), kept.numpy()).all()


@onnx_only
def test_quantized_pruned_head_keeps_head_bits(bundles):
    """The pruned head ([hidden, SIZE]) is found as the LM head: 8 bits in the q4_1 graph, like a full head."""
    import onnx

    graph = onnx.load(str(bundles["q4_1"] / "draft.onnx")).graph
    heads = [n for n in graph.node if n.op_type == "MatMulNBits"
             and {a.name: a.i for a in n.attribute}.get("N") == SIZE]
    assert len(heads) == 1 and {a.name: a.i for a in heads[0].attribute}["bits"] == 8


@onnx_only
@pytest.mark.parametrize("name", ["fp32", "int8", "fp32-explicit"])
def test_mirror_with_pruned_onnx_draft_equals_reference(bundles, name):
    loaded = load_parts(bundles[name], "ort:cpu", "ort:cpu", strict=True, threads=1)
    expected = flat(generate(loaded.target, PROMPT, 40))
    for gamma in (2, 5):
        got = decode(loaded.target, loaded.draft, PROMPT, mode="mirror", max_new_tokens=40, gamma=gamma)
        assert got.tokens == expected


@onnx_only
def test_manifest_records_the_kept_ids(bundles, kept):
    folder = bundles["fp32"]
    manifest = read_manifest(folder)
    assert manifest.draft_vocab["size"] == SIZE and manifest.vocab_size == VOCAB
    assert load_kept(folder / manifest.draft_vocab["file"], VOCAB).tolist() == kept.tolist()
    plain = manifest.to_dict()
    del plain["draft_vocab"]  # bundles exported without --draft-vocab
    assert BundleManifest.from_dict(plain).draft_vocab is None and "draft_vocab" not in \
        BundleManifest.from_dict(plain).to_dict()


@pytest.mark.skipif(not available_devices()["openvino"], reason="openvino not installed")
def test_openvino_draft_graph_equals_torch(tmp_path, tiny, kept):
    folder = _export(tmp_path / "ov", _kept_file(tmp_path, kept), fmt="openvino", draft_weights="fp32")
    draft = load_parts(folder, "openvino:CPU", "openvino:CPU", strict=True, threads=1).draft
    got, expected = _prompt_then_window(draft), _torch_logits(tiny, kept, PROMPT + WINDOW)
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_draft_vocab_refusals(tmp_path, kept):
    """One-line ExportErrors: torch bundles, SS drafts, a missing or malformed file, another vocabulary."""
    good = _kept_file(tmp_path, kept)
    cases = [({"fmt": "torch"}, good, "--draft-vocab needs --format onnx or openvino"),
             ({"fmt": "onnx", "draft_streams": str(tmp_path)}, good, "with --draft-streams"),
             ({"fmt": "onnx"}, str(tmp_path / "missing.json"), "--draft-vocab .*missing.json: not found"),
             ({"fmt": "onnx"}, str(save_kept(tmp_path / "big.json", kept, 300)), "vocabulary of 300 tokens")]
    bad = tmp_path / "unsorted.json"
    bad.write_text(json.dumps({"vocab_size": VOCAB, "kept": [5, 3]}))
    cases.append(({"fmt": "onnx"}, str(bad), "sorted ascending"))
    for options, path, message in cases:
        with pytest.raises(ExportError, match=message) as error:
            _export(tmp_path / "out", path, **options)
        assert "\n" not in str(error.value)


def test_nothing_held_out_is_null_not_a_coverage_of_zero(tmp_path):
    """Three questions hold none out: the summary said a held-out coverage of 0.0 (train-draft says null)."""
    import subprocess
    import sys

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "a", "turns": [f"question {i}"]}) + "\n"
                            for i in range(3)))
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "prune-vocab", "--target", "tiny", "--data",
                           str(data), "--size", "100", "--out", str(tmp_path / "kept.json"),
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["held_out_sequences"] == 0 and summary["held_out_coverage"] is None
