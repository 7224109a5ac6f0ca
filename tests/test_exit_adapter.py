"""Trained early exit: training lowers the loss, files round trip, output unchanged, bundles carry it."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch
from conftest import decode, load_parts, perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.exporters.export import ExportError, export_bundle
from mirror_rt.exporters.manifest import read_manifest
from mirror_rt.models.exit_adapter import (
    AdapterError,
    ExitAdapter,
    load_exit_adapter,
    save_exit_adapter,
)
from mirror_rt.models.loading import load_checkpoint
from mirror_rt.runtime.reference import generate
from mirror_rt.training.exit_data import ExitData, decode_batch
from mirror_rt.training.exit_training import (
    TrainExitConfig,
    evaluate_exit,
    fit,
    train_exit_main,
)

PROMPTS = [[5, 17, 42, 9, 80], [33, 61, 2, 14], [7, 7, 19, 50, 23, 11], [90, 3], [44, 45, 46], [12, 70, 8]]


def flat(steps):
    return [t for step in steps for t in step]


def random_adapter(model, exit_layer: int, seed: int = 0, scale: float = 2.0) -> ExitAdapter:
    """A non-identity adapter: it moves the early exit's top-k, as a trained one would."""
    torch.manual_seed(seed)
    adapter = ExitAdapter.for_model(model, exit_layer, rank=8)
    with torch.no_grad():
        adapter.up.weight.normal_(0.0, scale)
    return adapter.eval().requires_grad_(False)


def tiny_data(model, exit_layer: int) -> ExitData:
    rows = decode_batch(model, PROMPTS, exit_layer, 24, top_k=16, skip=1)
    return ExitData(hidden=torch.cat([r[1] for r in rows]), top_ids=torch.cat([r[2] for r in rows]).long(),
                    top_logprobs=torch.cat([r[3] for r in rows]).float(),
                    question=torch.cat([torch.full((len(r[1]),), i) for i, r in enumerate(rows)]),
                    is_answer=torch.cat([torch.arange(len(r[1])) >= r[4] for r in rows]))


def test_training_lowers_loss_and_raises_coverage():
    """A few dozen steps on the tiny target's own text: loss falls, top-1 coverage does not drop."""
    model = tiny_target(seed=2, vocab_size=97)
    data = tiny_data(model, exit_layer=1)
    adapter = ExitAdapter.for_model(model, 1, rank=8)
    before = evaluate_exit(model, 1, None, data)
    losses = fit(model, adapter, data, TrainExitConfig(steps=60, lr=1e-2, batch_size=64), None, progress=False)
    after = evaluate_exit(model, 1, adapter.eval(), data)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert after["top1"] >= before["top1"] and after["top8"] >= before["top8"]


def test_split_holds_out_every_fifth_question():
    """Held-out positions come only from questions 4, 9, ...; training never sees them."""
    data = tiny_data(tiny_target(seed=0), exit_layer=2)
    train, held_out = data.split(5)
    assert set(held_out.question.tolist()) == {4} and bool(held_out.is_answer.all())
    assert not bool(train.is_answer.all())  # training also sees prompt positions
    assert 4 not in set(train.question.tolist())
    assert len(train) + len(held_out) == len(data) - int(((data.question == 4) & ~data.is_answer).sum())


def test_a_rank_beyond_the_hidden_size_is_refused():
    with pytest.raises(AdapterError, match="--rank must be in 1.."):  # 99999999 asked for 230 GB
        ExitAdapter.for_model(tiny_target(seed=0), 1, rank=99999999)


def test_save_load_round_trip(tmp_path):
    """Weights and config survive the files; another model or exit layer is refused."""
    model = tiny_target(seed=0)
    adapter = random_adapter(model, 2)
    weights, meta = save_exit_adapter(adapter, tmp_path / "exit")
    assert weights.name == "exit.safetensors" and json.loads(meta.read_text())["rank"] == 8
    loaded = load_exit_adapter(tmp_path / "exit.safetensors", model)
    h = torch.randn(5, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype)
    assert torch.allclose(loaded(h), adapter(h), atol=1e-6)
    with pytest.raises(AdapterError, match="exit layer"):
        load_exit_adapter(tmp_path / "exit", model, exit_layer=1)
    with pytest.raises(AdapterError, match="another model"):
        load_exit_adapter(tmp_path / "exit", tiny_target(seed=0, vocab_size=101))
    (tmp_path / "exit.json").unlink()
    with pytest.raises(AdapterError, match=r"exit.safetensors: not an exit adapter .*missing exit.json"):
        load_exit_adapter(tmp_path / "exit.safetensors", model)  # the path given is named, and what is missing
    with pytest.raises(AdapterError, match=r"nope: not an exit adapter"):
        load_exit_adapter(tmp_path / "nope", model)


@pytest.mark.parametrize("seed", range(3))
def test_adapter_changes_only_branches(seed):
    """Mirror output with and without an adapter equals the reference; the early exit itself differs."""
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 100)
    prompt = [(seed * 7 + i * 13) % 95 + 2 for i in range(6)]
    expected = flat(generate(TorchModel(target), prompt, 40))
    adapter = random_adapter(target, 2, seed=seed)
    plain, adapted = TorchSplitTarget(target, 2, kappa=4), TorchSplitTarget(target, 2, kappa=4, exit_adapter=adapter)
    ids_plain, _ = plain.forward_prefix(prompt, plain.new_cache(16))
    ids_adapted, _ = adapted.forward_prefix(prompt, adapted.new_cache(16))
    assert not np.array_equal(ids_plain, ids_adapted)
    for split in (plain, adapted):
        assert decode(split, TorchModel(draft), prompt, mode="mirror", max_new_tokens=40, gamma=4).tokens == expected


def test_train_exit_main_end_to_end(tmp_path):
    """The CLI entry on the tiny preset: data generated once into the cache, report with before/after."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"question {i} " * 3]}) + "\n"
                            for i in range(10)))
    kwargs = dict(target="tiny", exit_layer=2, data=str(data), steps=12, rank=4, out=str(tmp_path / "a"),
                  progress=False, max_new_tokens=12, batch_size=32, cache=str(tmp_path / "cache"))
    report = train_exit_main(**kwargs)
    assert set(report["before"]) == {"top1", "top8", "positions"} and report["after"]["positions"] > 0
    assert (tmp_path / "a.safetensors").is_file() and not (tmp_path / "a.ckpt.pt").exists()
    assert len(list((tmp_path / "cache" / "exit-data").glob("*.answers.jsonl"))) == 1
    again = train_exit_main(**kwargs)  # same seed, cached data: the same adapter
    assert again["after"] == report["after"] and again["final_loss"] == pytest.approx(report["final_loss"])
    unranked = train_exit_main(**(kwargs | {"rank": None, "steps": 2, "out": str(tmp_path / "b")}))
    assert unranked["rank"] == 64  # the tiny model's hidden size: 512 was refused although no rank was given
    with pytest.raises(ValueError, match="cannot write to '': an empty path"):  # it trained into the cache
        train_exit_main(**(kwargs | {"out": ""}))


def test_export_refuses_mismatched_adapter(tmp_path):
    """An adapter for another exit layer fails before any conversion, naming --exit-adapter."""
    model = load_checkpoint("tiny", log=lambda *a: None).model
    save_exit_adapter(random_adapter(model, 1), tmp_path / "exit")
    with pytest.raises(ExportError, match="--exit-adapter"):
        export_bundle("tiny", tmp_path / "out", fmt="torch", exit_adapter=str(tmp_path / "exit"), progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino not installed")
def test_openvino_bundle_carries_adapter(tmp_path):
    """The exported prefix graph's top-kappa equals the torch split target's with the same adapter."""
    model = load_checkpoint("tiny", log=lambda *a: None).model
    adapter = random_adapter(model, 2, seed=5, scale=0.5)
    save_exit_adapter(adapter, tmp_path / "exit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # full-precision exit head, so log-probs compare tightly; fp32 draft: nncf's int8 compression leaves
        # worker threads behind (test_mirror counts threads)
        folder = export_bundle("tiny", tmp_path / "ov", fmt="openvino", kappa=4, exit_adapter=str(tmp_path / "exit"),
                               draft_weights="fp32", exit_weights="fp32", progress=False)
    manifest = read_manifest(folder)
    assert manifest.exit_adapter["in_graph"] and manifest.exit_adapter["rank"] == 8
    bundle = load_parts(folder, "openvino:CPU", "openvino:CPU", strict=True, threads=1)
    prompt = [5, 17, 42, 9, 80, 33, 61, 2, 14, 99, 7]
    ov_ids, ov_lp = bundle.target.forward_prefix(prompt, bundle.target.new_cache(32))
    ref = TorchSplitTarget(model, 2, kappa=4, exit_adapter=adapter)
    ids, lp = ref.forward_prefix(prompt, ref.new_cache(32))
    plain = TorchSplitTarget(model, 2, kappa=4)
    plain_ids, plain_lp = plain.forward_prefix(prompt, plain.new_cache(32))
    assert not np.array_equal(plain_ids, ids) and np.abs(plain_lp - lp).max() > 0.2  # the check discriminates
    np.testing.assert_allclose(ov_lp, lp, atol=1e-3)  # the same top-kappa log-probs, in order
    full = TorchSplitTarget(model, 2, kappa=model.config.vocab_size, exit_adapter=adapter)
    full_ids, full_lp = full.forward_prefix(prompt, full.new_cache(32))
    by_id = np.take_along_axis(full_lp, np.argsort(full_ids, axis=-1), axis=-1)  # [T, vocab] log-prob of each id
    np.testing.assert_allclose(np.take_along_axis(by_id, ov_ids, axis=-1), ov_lp, atol=1e-3)  # ids agree up to ties
    assert (ov_ids == ids).mean() > 0.8
