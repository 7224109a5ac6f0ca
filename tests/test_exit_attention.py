"""Attention exit adapters: the exit reads the last prefix layer's cached keys, in torch and in every graph."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from conftest import decode, load_parts, perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.exporters.export import export_bundle
from mirror_rt.exporters.manifest import read_manifest
from mirror_rt.models.exit_adapter import (
    AdapterError,
    ExitAdapter,
    load_exit_adapter,
    save_exit_adapter,
)
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.runtime.reference import generate
from mirror_rt.training.exit_data import (
    evaluate_sequences,
    sequence_data,
    split_sequences,
)
from mirror_rt.training.exit_training import TrainExitConfig, fit

PROMPT = [5, 17, 42, 9, 80, 33, 61, 2, 14, 91, 7]
WINDOW = [12, 70, 8, 44]


def attention_adapter(model, exit_layer: int, seed: int = 0, scale: float = 0.5) -> ExitAdapter:
    """A non-identity attention adapter: its attention read and low-rank map both move the exit's top-k."""
    torch.manual_seed(seed)
    adapter = ExitAdapter.for_model(model, exit_layer, rank=8, attention=True)
    with torch.no_grad():
        adapter.o_proj.weight.normal_(0.0, scale)
        adapter.up.weight.normal_(0.0, scale)
    return adapter.eval().requires_grad_(False)


def two_windows(split) -> tuple[np.ndarray, np.ndarray]:
    """Exit (ids, log-probs) of PROMPT, then of WINDOW after the prompt went through the suffix."""
    cache = split.new_cache(32)
    ids, lp = split.forward_prefix(PROMPT, cache)
    split.forward_suffix(cache)
    ids2, lp2 = split.forward_prefix(WINDOW, cache)
    split.forward_suffix(cache)
    return np.concatenate([ids, ids2]), np.concatenate([lp, lp2])


def test_attention_reads_context_and_windows_agree():
    """The exit depends on earlier positions (not only on the row), and equally so one window or two."""
    model = tiny_target(seed=3)
    adapter = attention_adapter(model, 2)
    split = TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter)
    ids, lp = two_windows(split)
    whole = TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter)
    all_ids, all_lp = whole.forward_prefix(PROMPT + WINDOW, whole.new_cache(32))
    np.testing.assert_allclose(lp, all_lp, atol=1e-9)
    assert np.array_equal(ids, all_ids)
    moved = [PROMPT[0] + 1] + PROMPT[1:]  # another first token: later exits change only through attention
    blind = TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter)
    _, moved_lp = blind.forward_prefix(moved + WINDOW, blind.new_cache(32))
    assert np.abs(moved_lp[-1] - all_lp[-1]).max() > 1e-6


def test_attention_adapter_files_and_refusals(tmp_path):
    """Round trip through the files; calling it without keys is refused in one line."""
    model = tiny_target(seed=1)
    adapter = attention_adapter(model, 2)
    save_exit_adapter(adapter, tmp_path / "exit")
    loaded = load_exit_adapter(tmp_path / "exit", model)
    assert loaded.config.attention and loaded.config.n_heads == model.config.n_heads
    a, b = TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter), TorchSplitTarget(model, 2, 4, exit_adapter=loaded)
    np.testing.assert_allclose(two_windows(a)[1], two_windows(b)[1], atol=1e-5)  # files hold float32
    with pytest.raises(AdapterError, match="keys"):
        loaded(torch.zeros(2, model.config.hidden_size, dtype=torch.float64))


def test_version_1_files_keep_their_formula(tmp_path):
    """An adapter saved before attention existed (version 1) loads and computes scale*n + up(down(n)) as trained."""
    import json

    model = tiny_target(seed=1)
    torch.manual_seed(0)
    adapter = ExitAdapter.for_model(model, 2, rank=8)
    with torch.no_grad():
        adapter.up.weight.normal_(0.0, 0.5)
        adapter.scale.mul_(1.7)
    weights, meta = save_exit_adapter(adapter, tmp_path / "old")
    record = json.loads(meta.read_text())
    for key in ("attention", "n_heads", "n_kv_heads", "head_dim"):
        record.pop(key)
    meta.write_text(json.dumps(dict(record, version=1)))
    loaded = load_exit_adapter(weights, model)
    h = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model.config.norm_eps)
    expected = loaded.scale * n + loaded.up(loaded.down(n))
    assert not loaded.config.attention
    torch.testing.assert_close(loaded(h), expected)


def test_sequence_training_lowers_loss_and_raises_coverage():
    """A few dozen steps on whole sequences of the tiny target's own text: loss falls, coverage does not drop."""
    model = tiny_target(seed=2)
    prompts = [[(7 * q + 3 * i) % 90 + 2 for i in range(4 + q % 3)] for q in range(10)]
    answers = [[t for step in generate(TorchModel(model), p, 20) for t in step] for p in prompts]
    seqs = sequence_data(model, prompts, answers, exit_layer=1, skip=1, top_k=16, progress=False)
    train, held_out = split_sequences(seqs, 5)
    assert [s.question for s in held_out] == [4, 9] and len(train) == 8
    assert seqs[0].keys.shape == (model.config.n_kv_heads, len(prompts[0]) + 20, model.config.head_dim)
    adapter = ExitAdapter.for_model(model, 1, rank=8, attention=True)
    before = evaluate_sequences(model, None, seqs)
    losses = fit(model, adapter, seqs, TrainExitConfig(steps=60, batch_size=64), None, progress=False)
    after = evaluate_sequences(model, adapter.eval(), seqs)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert after["top1"] >= before["top1"] and after["top8"] >= before["top8"]
    assert after["positions"] == 10 * 20


@pytest.mark.parametrize("seed", range(3))
def test_attention_adapter_changes_only_branches(seed):
    """Mirror with an attention adapter equals the reference greedy output."""
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 100)
    prompt = [(seed * 7 + i * 13) % 95 + 2 for i in range(6)]
    expected = [t for step in generate(TorchModel(target), prompt, 40) for t in step]
    split = TorchSplitTarget(target, 2, kappa=4, exit_adapter=attention_adapter(target, 2, seed=seed))
    assert decode(split, TorchModel(draft), prompt, mode="mirror", max_new_tokens=40, gamma=4).tokens == expected


BACKENDS = [("onnx", {"kv": "shared"}, "onnxruntime", "ort:cpu"),
            ("onnx", {"kv": "explicit"}, "onnxruntime", "ort:cpu"),
            ("openvino", {}, "openvino", "openvino:CPU"),
            ("openvino", {"static": True, "max_context": 48, "max_window": 4}, "openvino", "openvino:CPU")]


@pytest.mark.parametrize("fmt,options,module,device", BACKENDS)
def test_bundle_exit_equals_torch(tmp_path, fmt, options, module, device):
    """The exported prefix + exit graphs give the torch split's top-kappa over two windows (static graphs:
    fixed windows over a fixed-size KV buffer whose later slots must stay masked)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed")
    model = load_checkpoint("tiny", log=lambda *a: None).model
    adapter = attention_adapter(model, 2, seed=5)
    save_exit_adapter(adapter, tmp_path / "exit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = export_bundle("tiny", tmp_path / fmt, fmt=fmt, kappa=4, exit_adapter=str(tmp_path / "exit"),
                               exit_weights="fp32", draft_weights="fp32", progress=False, **options)
    assert read_manifest(folder).exit_adapter["attention"]
    bundle = load_parts(folder, device, device, strict=True, threads=1)
    got_ids, got_lp = two_windows(bundle.target)
    ids, lp = two_windows(TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter))
    _, plain_lp = two_windows(TorchSplitTarget(model, 2, kappa=4))
    assert np.abs(plain_lp - lp).max() > 0.2  # the adapter moves the exit, so the check discriminates
    np.testing.assert_allclose(got_lp, lp, atol=1e-3)
    assert (got_ids == ids).mean() > 0.8  # ids agree up to near ties
