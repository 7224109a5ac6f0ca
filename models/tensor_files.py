"""safetensors files written with the permissions any other file gets here.

safetensors writes its files 0600, so a bundle, an exit adapter or trained streams copied for another account (or
served by one) could not be read there, while the JSON beside them could (0644 under the usual umask).
"""

from __future__ import annotations

import os
from pathlib import Path


def save_tensors(tensors: dict, path) -> None:
    """`tensors` (name -> torch tensor) to `path` as safetensors, readable as the umask allows."""
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)
