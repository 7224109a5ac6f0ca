"""Unfinished folders a killed process left: `NAME.partial-PID[-...]` (or `NAME.partial-PID.partial-PID`: the
default bundle's export stages inside a staging name of its own) beside the folder it was writing.

Every writer of a cached folder (the default model's conversion, a bundle's export, ONNX Runtime's session cache)
writes into such a folder of its own and renames it when complete; the next writer of the same folder removes
those whose process no longer runs (a SIGTERM or SIGKILL mid-write), which nothing would ever read.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path


def partial_folder(folder: Path) -> Path:
    """This process's unfinished copy of `folder`."""
    return Path(f"{folder}.partial-{os.getpid()}")


def sweep_partials(folder: Path) -> None:
    """Remove `folder`'s unfinished siblings (`NAME.partial-PID[-...]`) whose process no longer runs."""
    sweep_dead(Path(folder).parent, f"{Path(folder).name}.partial-")


def sweep_dead(parent: Path, stem: str) -> None:
    """Remove the folders `STEM + PID[-...]` in `parent` whose process no longer runs."""
    for partial in Path(parent).glob(f"{glob.escape(stem)}*"):
        pid = re.match(r"(\d+)(?:[-.]|$)", partial.name[len(stem):])
        if pid and not process_running(int(pid.group(1))):
            shutil.rmtree(partial, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts as running): a folder it was writing is still its own."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
