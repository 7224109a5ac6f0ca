"""A family draft beside a GGUF target (`--model T.gguf --draft-model D.gguf`): the target's bundle is the one
`--model T.gguf` alone uses, the draft gets a bundle of its own; and replay rows over such bundles.

Tiny GGUFs (tests/gguf_support.py: the default model's vocabulary, random weights); the 7B with its 0.5B draft is a
benchmark (docs/performance.md), not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_support import default_gguf, write_gguf

pytestmark = pytest.mark.slow  # the default model's GGUF (its vocabulary), fetched once


@pytest.fixture(scope="module")
def family(cache_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): two-layer qwen2 models of other weights, the target with 64 padding rows more."""
    vocab = default_gguf(cache_dir)
    folder = tmp_path_factory.mktemp("family")
    return (write_gguf(folder / "target.gguf", vocab, "qwen2", seed=7, vocab_rows=49152 + 64),
            write_gguf(folder / "draft.gguf", vocab, "qwen2", seed=8))


def _bundles(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "bundles").iterdir())


def test_the_target_bundle_is_exported_once_whatever_the_draft(family, tmp_path, monkeypatch):
    from mirror_rt.devices import engines
    from mirror_rt.devices.options import EngineConfig

    target, draft = family
    cache = tmp_path / "cache"
    alone = engines.load_engine(EngineConfig.from_flags(model=str(target), cache_dir=str(cache)), log=lambda *a: None)
    ar = alone.generate("Hello there", mode="ar", max_new_tokens=16, ignore_eos=True).tokens
    alone.close()
    (target_bundle,) = _bundles(cache)
    exported = []
    real_export = engines.export_bundle_of
    monkeypatch.setattr(engines, "export_bundle_of", lambda model, out, *a, **k: exported.append(
        (Path(model).name, k.get("draft_model"))) or real_export(model, out, *a, **k))
    paired = engines.load_engine(EngineConfig.from_flags(model=str(target), draft_model=str(draft),
                                                         cache_dir=str(cache)), log=lambda *a: None)
    assert exported == [("draft.gguf", None)]  # the draft alone: the target's bundle was there
    assert _bundles(cache) == sorted([target_bundle, next(b for b in _bundles(cache) if b.startswith("draft-"))])
    assert target_bundle.startswith("target-") and paired.names["target"].startswith(str(cache / "bundles" /
                                                                                        target_bundle))
    assert paired.draft.vocab_size < paired.target.vocab_size  # its own embedding: the draft's bundle
    for mode in ("sd", "mirror"):
        assert paired.generate("Hello there", mode=mode, max_new_tokens=16, ignore_eos=True).tokens == ar, mode
    paired.close()


def test_a_draft_of_another_vocabulary_is_refused(family, tmp_path, monkeypatch):
    """Checked on the bundles' tokenizer files (each bundle is exported first), in one line."""
    from mirror_rt.devices import engines
    from mirror_rt.models import tokenizer_files

    compared = []
    monkeypatch.setattr(engines, "export_bundle_of", lambda model, out, *a, **k: _fake_bundle(out))
    monkeypatch.setattr(tokenizer_files, "same_vocabulary", lambda a, b: compared.append((a, b)) or False)
    with pytest.raises(engines.GenerationError, match="must share the target's tokenizer"):
        engines.model_bundles(str(family[0]), str(family[1]), str(tmp_path / "cache"), log=lambda *a: None)
    assert [(a.name.split("-")[0], b.name.split("-")[0]) for a, b in compared] == [("draft", "target")]


def _fake_bundle(out: Path) -> None:
    """A bundle folder `read_manifest` takes (the default bundle's manifest, no graphs: never loaded)."""
    import shutil

    from mirror_rt.devices.engines import default_bundle_folder

    out.mkdir(parents=True)
    shutil.copyfile(default_bundle_folder() / "manifest.json", out / "manifest.json")


def test_replay_rows_over_a_family_pair_equal_ar_and_leave_one_bundle_each(family, tmp_path):
    """`bench --model T.gguf --draft-model D.gguf --methods ar,mirror-replay:1.0,mirror-replay:0.5`: the bench's own
    check (exit 1 on any greedy mismatch) passes, and the cache holds the two bundles only."""
    target, draft = family
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["Name three colours."]}) + "\n")
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", str(target),
                           "--draft-model", str(draft), "--cache-dir", str(cache), "--methods",
                           "ar,mirror-replay:1.0,mirror-replay:0.5", "--max-new-tokens", "24",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["mismatches"]["mirror-replay:1.0"] == 0 and doc["mismatches"]["mirror-replay:0.5"] == 0
    figures = doc["summary"]["overall"]
    assert figures["mirror-replay:1.0"]["mean_accepted_length"] > figures["mirror-replay:0.5"]["mean_accepted_length"]
    assert [b.split("-")[0] for b in _bundles(cache)] == ["draft", "target"]
