"""The loss figures every training loop shares: a step's loss checked finite, and the summary of a run's losses."""

from __future__ import annotations

import torch


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
