"""Check the one-way dependencies between code folders (import-linter contracts in pyproject.toml).

The code folders install as `mirror_rt.<folder>` through setuptools' package-dir mapping, so no
folder on disk holds the whole `mirror_rt` package and import-linter (grimp) cannot walk it in
place. This script stages the installed layout as symbolic links in a temporary folder
(`mirror_rt/` with each mapped folder linked inside it) and runs `lint-imports` over it.
Exit code: lint-imports' (non-zero when a contract is broken, naming the import).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def stage(into: Path) -> None:
    """mirror_rt/ as installed: the facade's files plus a link per mapped code folder."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = into / "mirror_rt"
    package.mkdir()
    for path in (ROOT / mapping["mirror_rt"]).glob("*.py"):
        (package / path.name).symlink_to(path)
    for name, folder in mapping.items():
        if name != "mirror_rt":
            (package / name.split(".", 1)[1]).symlink_to(ROOT / folder, target_is_directory=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        stage(Path(tmp))
        env = dict(os.environ, PYTHONPATH=tmp + os.pathsep + os.environ.get("PYTHONPATH", ""))
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], env=env,
                              cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
