"""`mirror-rt export --out` writes a bundle beside its place and swaps it in when complete: it never writes into a
folder of other files (`--out /` wrote 900 MB into the root), a place that refuses writing is one line before any
model loads, and an interrupted re-export leaves the earlier bundle working (it deleted its manifest first)."""

from __future__ import annotations

import os

import pytest

import mirror_rt.exporters.export as export
from mirror_rt.exporters.export import export_bundle
from mirror_rt.exporters.export_config import ExportError
from mirror_rt.exporters.manifest import read_manifest


def _bundle(path):
    return export_bundle("tiny", path, fmt="torch", kappa=4, progress=False)


def test_a_folder_of_other_files_is_refused_untouched(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "config.json").write_text("mine")
    with pytest.raises(ExportError, match="holds other files and no bundle"):
        _bundle(other)
    assert sorted(p.name for p in other.iterdir()) == ["config.json"] and (other / "config.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # nothing staged beside it


@pytest.mark.parametrize("where, says", [("/", "holds other files"), ("/proc/mirror-rt-bundle", "cannot write to")])
def test_places_that_cannot_take_a_bundle_are_one_line(where, says):
    with pytest.raises(ExportError, match=says):
        _bundle(where)


def test_the_current_folder_is_refused_even_when_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportError, match="name a new folder"):
        _bundle(".")
    assert not os.listdir(tmp_path)


def test_an_interrupted_re_export_leaves_the_bundle_working(tmp_path, monkeypatch):
    folder = _bundle(tmp_path / "bundle")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_export_role", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _bundle(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    read_manifest(folder)  # still a whole bundle, every file's hash checked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # the staging folder went


def test_a_re_export_replaces_the_bundle(tmp_path):
    folder = _bundle(tmp_path / "bundle")
    (folder / "stale.txt").write_text("from an older export")
    assert _bundle(folder) == folder.absolute()
    assert not (folder / "stale.txt").exists() and read_manifest(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
