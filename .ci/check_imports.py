"""Check the one-way dependencies between code folders (import-linter contracts in pyproject.toml).

The code folders install as `mirror_rt.<folder>` through setuptools' package-dir mapping, and
`mirror_rt/` holds a symbolic link to each mapped folder (`mirror_rt/runtime -> ../runtime`), so
the source tree itself has the installed layout: import-linter (grimp), editors and structure
viewers read `mirror_rt.runtime` from the repository root. This script checks that every mapping
has its link, then runs `lint-imports` in place.
Exit code: 1 when a link is missing or wrong, else lint-imports' (non-zero when a contract is broken).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def missing_links() -> list[str]:
    """The mapped folders without their link in mirror_rt/ (`mirror_rt/<name> -> ../<folder>`)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    wrong = []
    for name, folder in mapping.items():
        if name == "mirror_rt":
            continue
        link = ROOT / "mirror_rt" / name.split(".", 1)[1]
        if not link.is_symlink() or link.resolve() != (ROOT / folder).resolve():
            wrong.append(f"{link.relative_to(ROOT)} -> ../{folder}")
    return wrong


def main() -> int:
    wrong = missing_links()
    if wrong:
        print(f"check_imports: missing or wrong links (ln -s): {', '.join(wrong)}", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], env=env,
                          cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
