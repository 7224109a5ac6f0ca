"""The `mirror-rt` console script in a subprocess, as a user runs it, optionally on a machine made different by
tests/site_hooks/sitecustomize.py (a module hidden as if its extra were not installed, a peer that crashes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).resolve().parent / "site_hooks"


def hooked_env(crash: str | None = None, hide: str | None = None, **extra: str) -> dict:
    """This environment with the site hooks on the path: GenAI pipelines dying at `crash` (build, generate), the
    modules of `hide` (comma-separated) not importable; `extra` variables set."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("MIRROR_RT_TEST_CRASH", "MIRROR_RT_TEST_HIDE"):
        env.pop(name, None)
    hooks = {"MIRROR_RT_TEST_CRASH": crash, "MIRROR_RT_TEST_HIDE": hide}
    return env | {k: v for k, v in hooks.items() if v} | extra


def console(*args: str, crash: str | None = None, hide: str | None = None, timeout: int = 600,
            **extra: str) -> subprocess.CompletedProcess:
    """`mirror-rt ARGS` (the installed console script, importing this tree) in a subprocess."""
    script = shutil.which("mirror-rt", path=str(Path(sys.executable).parent)) or shutil.which("mirror-rt")
    assert script, "the mirror-rt console script is not installed (pip install -e .)"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=timeout,
                          env=hooked_env(crash, hide, **extra))
