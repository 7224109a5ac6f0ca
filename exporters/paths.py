"""Output paths checked before any model is loaded: a command that cannot write its result fails at once.

`check_writable` walks up to the nearest existing ancestor of the path and asks whether it is a
folder this process may write into; it creates nothing. Used by `export` (the bundle folder) and the
training commands (their output files and folders).
"""

from __future__ import annotations

import os
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written (one-line message naming it)."""


def check_writable(path, folder: bool = True) -> Path:
    """`path` itself (a folder when `folder`, else a file) can be created or overwritten; returns it."""
    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            raise OutputPathError(f"cannot write to {path}: it is a file, a folder is needed")
        if not folder and path.is_dir():
            raise OutputPathError(f"cannot write to {path}: it is a folder, a file is needed")
        if not os.access(path if folder else path.parent, os.W_OK | os.X_OK):
            raise OutputPathError(f"cannot write to {path}: permission denied")
        return path
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"cannot write to {path}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write to {path}: {ancestor} is not writable")
    return path
