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
    gone = [tmp_path / f"bundle-0.6.0.partial-{dead.pid}", tmp_path / f"bundle-0.6.0.partial-{dead.pid}-1234"]
    kept = [tmp_path / f"bundle-0.6.0.partial-{os.getpid()}-99", tmp_path / "bundle-0.6.0-w8a8.partial-1",
            tmp_path / "other.partial-1", folder]
    for f in gone + kept:
        (f / "sub").mkdir(parents=True)
    sweep_partials(folder)
    assert [f.exists() for f in gone] == [False, False]
    assert all(f.exists() for f in kept)
