"""The house: README's Layout table, the installed packages and the folders on disk agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
NOT_CODE = {"tests", "docs", "build", "dist"}


def package_dirs() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def test_readme_layout_table_matches_the_installed_packages():
    """Every row `| folder/ | package |` is a package-dir mapping, and every mapping has a row."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    rows = dict(re.findall(r"^\| `(\w+)/` \| `(mirror_rt(?:\.\w+)?)` \|", layout, re.M))
    assert rows == {folder: package for package, folder in package_dirs().items()}


def test_every_code_folder_installs():
    """A top-level folder holding Python code is a mapped package (with its __init__.py): no orphan rooms."""
    mapping = package_dirs()
    folders = {p.name for p in ROOT.iterdir()
               if p.is_dir() and not p.name.startswith(".") and p.name not in NOT_CODE and any(p.glob("*.py"))}
    assert folders == set(mapping.values())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    subpackages = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
                   for name, folder in mapping.items() for init in (ROOT / folder).glob("*/__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(set(mapping) | subpackages)
    assert all((ROOT / folder / "__init__.py").is_file() for folder in folders)


def test_mirror_rt_links_every_code_folder_for_tools():
    """mirror_rt/<folder> links to each mapped folder, so tools read the installed layout in the source tree."""
    links = {p.name: p for p in (ROOT / "mirror_rt").iterdir() if p.is_symlink()}
    expected = {package.split(".", 1)[1]: folder for package, folder in package_dirs().items() if "." in package}
    assert set(links) == set(expected)
    assert all(links[name].resolve() == (ROOT / folder).resolve() for name, folder in expected.items())
