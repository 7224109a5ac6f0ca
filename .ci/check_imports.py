"""Check the one-way dependencies between code folders (import-linter contracts in pyproject.toml).

The code folders install as `mirror_rt.<folder>` through setuptools' package-dir mapping, and
`mirror_rt/` holds a symbolic link to each mapped folder (`mirror_rt/runtime -> ../runtime`), so
the source tree itself has the installed layout: import-linter (grimp), editors and structure
viewers read `mirror_rt.runtime` from the repository root. Sub-folders (`runtime/batch/`, `devices/torch/`,
`mirror_rt/cli/`) install through their parent's mapping but must be listed in `packages`. This script checks
that every mapping has its link and every package folder is listed, then runs `lint-imports` in place.
Exit code: 1 when a link is missing or wrong or a package unlisted, else lint-imports' (non-zero when a contract
is broken).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def missing_links() -> list[str]:
    """The mapped folders without their link in mirror_rt/ (`mirror_rt/<name> -> ../<folder>`)."""
    mapping = setuptools_table()["package-dir"]
    wrong = []
    for name, folder in mapping.items():
        if name == "mirror_rt":
            continue
        link = ROOT / "mirror_rt" / name.split(".", 1)[1]
        if not link.is_symlink() or link.resolve() != (ROOT / folder).resolve():
            wrong.append(f"{link.relative_to(ROOT)} -> ../{folder}")
    return wrong


def unlisted_packages() -> list[str]:
    """Package folders (an __init__.py) under a mapped folder that `packages` does not list: a wheel would lack
    them."""
    table = setuptools_table()
    found = set()
    for name, folder in table["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    return sorted(found - set(table["packages"]))


def main() -> int:
    wrong = missing_links()
    if wrong:
        print(f"check_imports: missing or wrong links (ln -s): {', '.join(wrong)}", file=sys.stderr)
        return 1
    unlisted = unlisted_packages()
    if unlisted:
        print(f"check_imports: packages missing from pyproject's packages: {', '.join(unlisted)}", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], env=env,
                          cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
