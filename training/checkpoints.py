"""What every training loop shares: checkpoints written atomically and read with `weights_only=True` (a file holding
anything but tensors, numbers and strings is refused in one line, never run), and the loss figures.
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


def loss_summary(losses: list[float], window: int = 20) -> dict:
    """The mean loss of the first and of the last `window` steps (the bar shows the latter as it trains), over at
    most half the steps each, so the two never share a step; null when no step ran."""
    n = min(window, len(losses) // 2) or len(losses)
    if not losses:
        return {"first_loss": None, "final_loss": None, "loss_mean_over_steps": 0}
    return {"first_loss": round(sum(losses[:n]) / n, 4), "final_loss": round(sum(losses[-n:]) / n, 4),
            "loss_mean_over_steps": n}


def finite_loss(loss: torch.Tensor, step: int) -> float:
    """The step's loss as a number; ValueError when it is NaN or infinite (the training diverged): stopped before
    the optimizer applies it, so the last checkpoint and the weights written stay finite."""
    value = loss.item()
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"the training diverged at step {step + 1}: the loss is {value} (try a lower --lr)")
    return value
