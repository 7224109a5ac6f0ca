"""Output paths checked before any model is loaded: a command that cannot write its result fails at once.

`check_writable` walks up to the nearest existing ancestor of the path and asks whether it is a
folder this process may write into; it creates nothing. Used by `export` (the bundle folder) and the
training commands (their output files and folders). A bundle is written into a staging folder beside its
place and swapped in when complete (`staging_folder`, `swap_in`); what a killed process left is swept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mirror_rt.models.partials import sweep_partials


class OutputPathError(ValueError):
    """An output path that cannot be written (one-line message naming it)."""


def check_writable(path, folder: bool = True) -> Path:
    """`path` itself (a folder when `folder`, else a file) can be created or overwritten; returns it."""
    if not str(path).strip():  # Path("") is the current folder: a bench or a check would write its files there
        raise OutputPathError(f"cannot write to {str(path)!r}: an empty path (name a {'folder' if folder else 'file'})")
    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            raise OutputPathError(f"cannot write to {path}: it is a file, a folder is needed")
        if not folder and path.is_dir():
            raise OutputPathError(f"cannot write to {path}: it is a folder, a file is needed")
        if not os.access(path if folder else path.parent, os.W_OK | os.X_OK):
            raise OutputPathError(f"cannot write to {path}: permission denied")
        _probe(path if folder else path.parent, path)
        return path
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"cannot write to {path}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write to {path}: {ancestor} is not writable")
    _probe(ancestor, path)
    return path


def _probe(folder: Path, path: Path) -> None:
    """Create and remove a file in `folder`: places that refuse files whatever their permission bits say (/proc,
    /sys, a read-only mount as root) are found before the work, not after it."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise OutputPathError(f"cannot write to {path}: {exc.strerror or exc}") from None


def check_bundle_folder(path, manifest: str) -> Path:
    """`path` as a bundle's folder to (re)write, absolute: new, empty, or an earlier bundle (it holds `manifest`);
    never a folder of other files (a bundle's files would land among them: `--out /` wrote into the root)."""
    given = str(path)
    if not given.strip():
        raise OutputPathError("--out is empty: name the bundle's folder")
    out = check_writable(Path(path)).absolute()
    if out.exists() and any(out.iterdir()) and not (out / manifest).is_file():
        raise OutputPathError(f"cannot write the bundle into {given}: it holds other files and no bundle "
                              f"(name a new or empty folder)")
    if out.exists() and out.resolve() in (Path.cwd().resolve(), Path(out.anchor)):
        raise OutputPathError(f"cannot write the bundle into {given}: name a new folder")
    return out


def staging_folder(out: Path) -> Path:
    """A new folder beside `out` that the export writes into (`NAME.partial-PID`, swept when its process is gone);
    OutputPathError where it cannot be made (a place that refuses writing: /sys, /proc)."""
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    sweep_partials(out)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as exc:
        raise OutputPathError(f"cannot write to {out}: {exc.strerror or exc}") from None
    return staging


def swap_in(staging: Path, out: Path) -> None:
    """Put the finished `staging` folder in `out`'s place; an earlier bundle there goes only once it is in."""
    old = out.with_name(f"{out.name}.partial-{os.getpid()}-old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
