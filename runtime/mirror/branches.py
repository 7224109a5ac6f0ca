"""Branch roots: which corrections the draft precomputes continuations for. Pure functions.

A root (depth j, token r) stands for the verdict "accepted j window tokens, then r"; the main line is always
rolled out first, the others ranked by P(root). Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class Root:
    """A candidate verdict worth precomputing."""

    score: float  # estimated probability (higher first after sorting in reverse)
    depth: int  # accepted window tokens before the root
    token: int  # the root token (correction, or bonus at depth k)


def rank_roots(window: list[int], line_bonus: int | None, draft_alternatives: list[dict[int, float]],
               exit_candidates: list[dict[int, float]] | None, acceptance: float,
               exit_weight: float = 0.5) -> list[Root]:
    """Roots sorted by estimated probability, excluding the main line (`line_bonus`, the draft's guess after a full
    `window`). Per depth 0..k: `draft_alternatives` {token: q}, `exit_candidates` {token: p} or None before the early
    exit arrives; `acceptance` the running per-token rate."""
    k = len(window)
    a = min(max(acceptance, 0.0), 0.999)
    roots = []
    for j in range(k + 1):
        own = window[j] if j < k else line_bonus
        reach = a ** j * ((1 - a) if j < k else 1.0)
        mix = _mixture(draft_alternatives[j] if j < len(draft_alternatives) else {},
                       exit_candidates[j] if exit_candidates and j < len(exit_candidates) else {},
                       own, exit_weight if exit_candidates else 0.0)
        roots.extend(Root(reach * p, j, token) for token, p in mix.items())
    return sorted(roots, reverse=True)


def _mixture(draft: dict[int, float], exit_: dict[int, float], own: int | None, exit_weight: float):
    """P(token | not `own`) as a weighted mixture of the two renormalised candidate sets."""
    out: dict[int, float] = {}
    for weight, dist in ((1 - exit_weight, draft), (exit_weight, exit_)):
        rest = {t: p for t, p in dist.items() if t != own}
        total = sum(rest.values())
        if weight <= 0 or total <= 0:
            continue
        for t, p in rest.items():
            out[t] = out.get(t, 0.0) + weight * p / total
    return out


def top_alternatives(q_row: np.ndarray, count: int) -> dict[int, float]:
    """The `count` most likely tokens of a probability row [vocab] as {token: probability}."""
    count = min(count, q_row.shape[-1])
    idx = np.argpartition(-q_row, count - 1)[:count]
    return {int(t): float(q_row[t]) for t in idx}


def exit_distribution(ids: np.ndarray, logprobs: np.ndarray) -> list[dict[int, float]]:
    """Early-exit message rows [k+1, kappa] -> per depth {token: probability}."""
    return [{int(t): float(np.exp(lp)) for t, lp in zip(row_ids, row_lp)} for row_ids, row_lp in zip(ids, logprobs)]
