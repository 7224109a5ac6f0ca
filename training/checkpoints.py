"""Training checkpoints (optimizer state, RNG state, losses) written and read safely.

Checkpoints hold only tensors, numbers, strings and containers of them, so they are read with
`torch.load(weights_only=True)`: a file that holds anything else (code, another program's
pickle) is refused in one line instead of being run. Writes go to a temporary file renamed
at the end, so an interrupted save never leaves half a checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from mirror_rt.runtime.values import error_line


class CheckpointError(ValueError):
    """A checkpoint file that is not one of ours (one-line message naming the file)."""


def save_state(path: Path, state: dict) -> None:
    """Write `state` to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_state(path: Path, keys: tuple[str, ...]) -> dict:
    """The state dict of `path`, read without running code; it must hold every one of `keys`."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a mirror-rt training checkpoint ({error_line(exc)[:160]})") from None
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise CheckpointError(f"{path}: not a mirror-rt training checkpoint (expected the entries {', '.join(keys)})")
    return state
