"""Replay drafts (evaluation.replay): the target's own greedy text proposed, each token kept with probability alpha;
the real draft's forwards still run; the output stays the target's."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mirror_rt.evaluation.replay import Recordings, replay_engine, replay_method, replay_of
from mirror_rt.runtime.config import GenerationConfig


@pytest.fixture(scope="module")
def replayed():
    """A replay engine over the tiny torch preset (its int8 draft), and its recordings."""
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.devices.torch_engine import load_torch

    loaded = load_torch(EngineConfig.from_flags(model="tiny"), "mirror", log=lambda *a: None)
    loaded.batch = replace(loaded.batch, adaptive_speculation=False)  # speculating at every step, whatever it costs
    engine, recorder = replay_engine(loaded), replay_engine(loaded, draft=False)
    yield engine, Recordings(recorder)
    for e in (engine, recorder, loaded):
        e.close()


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_the_output_is_the_targets_and_acceptance_follows_alpha(replayed, mode, monkeypatch):
    """alpha 1: every drafted token is accepted; alpha 0: none is; in between some are. The text is ar's each time,
    and the real draft ran its forwards (their cost is real)."""
    engine, recordings = replayed
    forwards = []
    inner = engine.draft.draft
    for name in ("forward", "forward_rows"):  # one sequence's calls, or shared draft calls over pool rows
        real = getattr(inner, name)
        monkeypatch.setattr(inner, name, lambda *a, real=real, **k: forwards.append(len(a[0])) or real(*a, **k))
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    prompt = engine.prompt_ids("count to ten")
    text = recordings.continuation(prompt, config)
    assert len(text) == 40
    counts = {}
    for alpha in (1.0, 0.6, 0.0):
        engine.draft.replay = replay_of(prompt, text, alpha, config.seed, engine.draft.vocab_size)
        forwards.clear()
        gen = engine.generate(prompt, config, mode=mode)
        assert gen.tokens == text, alpha
        counts[alpha] = (sum(s.drafted for s in gen.steps), sum(s.accepted for s in gen.steps))
        assert forwards, alpha
    engine.draft.replay = None
    assert counts[1.0][0] > 0 and counts[1.0][1] == counts[1.0][0]
    assert counts[0.0][0] > 0 and counts[0.0][1] == 0
    assert 0 < counts[0.6][1] < counts[0.6][0]


def test_a_replay_keeps_each_position_by_a_seeded_coin_else_proposes_another_token():
    prompt, text = [5, 6, 7], list(range(10, 410))
    replay = replay_of(prompt, text, 0.7, seed=3, vocab=500)
    proposed = replay.proposed[replay.start:]
    kept = proposed == np.asarray(text)
    assert replay.start == 3 and 0.6 < kept.mean() < 0.8
    assert (proposed[~kept] != np.asarray(text)[~kept]).all()
    again = replay_of(prompt, text, 0.7, seed=3, vocab=500)
    assert (again.proposed == replay.proposed).all()
    assert (replay_of(prompt, text, 1.0, 3, 500).proposed[3:] == text).all()
    assert (replay_of(prompt, text, 0.0, 3, 500).proposed[3:] != text).all()


def test_replay_method_names_and_their_alpha():
    from mirror_rt.evaluation.bench_methods import check_methods

    assert replay_method("mirror-replay") == ("mirror", 1.0)
    assert replay_method("mirror-replay:0.7") == ("mirror", 0.7)
    assert replay_method("sd-replay:0") == ("sd", 0.0)
    assert replay_method("mirror") is None
    for bad in ("mirror-replay:1.5", "mirror-replay:x", "sd-replay:nan"):
        with pytest.raises(ValueError, match="alpha must be a number in"):
            replay_method(bad)
    check_methods(["ar", "mirror-replay:0.5"])
    with pytest.raises(ValueError, match=r"mirror-replay\[:alpha\]"):
        check_methods(["mirror-replays"])


def test_bench_rows_say_acceptance_was_replayed_and_equal_ar(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["count to ten"]}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", "tiny",
                           "--methods", "ar,mirror-replay:0.5,sd-replay", "--max-new-tokens", "16", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["replayed"] == {"mirror-replay:0.5": 0.5, "sd-replay": 1.0}
    assert doc["mismatches"]["mirror-replay:0.5"] == 0 and doc["mismatches"]["sd-replay"] == 0
    assert doc["references"]["sd-replay"].startswith("ar-")
    assert "kept with probability 0.5" in doc["paths"]["mirror-replay:0.5"]
    note = next(line for line in (out / "report.md").read_text().splitlines() if line.startswith("Acceptance was"))
    assert "`mirror-replay:0.5` (alpha 0.5)" in note and "`sd-replay` (alpha 1)" in note
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", "tiny",
                           "--methods", "mirror-replay:2", "--out", str(tmp_path / "bad")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "alpha must be a number in [0, 1]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ar_rows_run_on_the_replay_engines_target_where_its_threads_match(tmp_path, monkeypatch):
    """A bench of ar and replay rows over one bundle loads the target once per thread count, not once per row: the ar
    row at the Mirror engine's target threads runs on that target's sessions (a 7B is not loaded three times)."""
    from mirror_rt.devices import bundle_engine, bundles  # noqa: F401 -- the engine's loader, bound before the patch
    from mirror_rt.evaluation.bench_engines import bundle_runners
    from mirror_rt.exporters.export import export_bundle

    folder = export_bundle("tiny", tmp_path / "bundle", progress=False)
    loads = []
    real = bundles.load_model
    monkeypatch.setattr(bundles, "load_model", lambda *a, **k: loads.append(a[2]) or real(*a, **k))
    runners = bundle_runners(["ar", "mirror-replay:1.0", "mirror-replay:0.7"], str(folder), log=lambda *a: None)
    replays = [r for r in runners if r.name.startswith("mirror-replay")]
    threads = replays[0].engine.placement.target_threads
    shared = next(r for r in runners if r.name == f"ar-ort-{threads}t")
    assert shared.engine.target is replays[0].engine.target is replays[1].engine.target
    assert "mirror engine's target sessions" in shared.label
    from mirror_rt.runtime.affinity import available_cores

    wide = len(available_cores()) > 1 and shared.engine.target.capabilities.wide  # its target-only steps' sessions
    assert ("target-only steps on its sessions over every core" in shared.label) == wide
    ar_rows = [r for r in runners if r.target_only]
    assert loads.count("target") == len(ar_rows) - 1  # each ar row's but the one on the Mirror engine's target
    assert all(r.engine.target is not shared.engine.target for r in ar_rows if r is not shared)
    for runner in runners:
        runner.engine.close()
