"""The acceptance rule: target scores in, `Verdict` out. Pure: no model, no cache, no I/O.

Notation (Leviathan et al.; transformers): **p = target probabilities, q = draft
probabilities** (gpt-fast uses the opposite). A window of k draft tokens d_1..d_k is scored
by one target forward over [last, d_1..d_k], giving k+1 rows: row j predicts the token
after d_j (row 0 predicts d_1).
- greedy: accept the longest prefix with d_j == argmax(row j-1); the **correction** is the
  target's argmax at the first mismatch, the **bonus** its argmax after a full window.
- sampling: accept d_j with probability min(1, p(d_j)/q(d_j)); on rejection the
  correction is drawn from norm(max(0, p - q)); after a full window the bonus from p.
  The committed tokens then have exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mirror_rt.runtime.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """The target's decision on one window."""

    base_length: int  # committed length the window continued from (alignment check)
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # correction if a token was rejected, bonus if all were accepted
    # committed tokens = window[:num_accepted] + [next_token]


def accept_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray, base_length: int = 0) -> Verdict:
    """Longest-prefix match against the target's argmax.

    Args:
        draft_tokens: [k] proposed ids.
        target_logits: [k+1, vocab] target logits over [last, d_1..d_k].
    Example:
        draft [5, 7, 9], target argmax rows [5, 7, 3, 4] -> accepted 2, correction 3.
    """
    target = np.argmax(target_logits, axis=-1)  # [k+1]
    k = len(draft_tokens)
    n = 0
    while n < k and draft_tokens[n] == target[n]:
        n += 1
    return Verdict(base_length, n, int(target[n]))


def accept_sampled(draft_tokens: Sequence[int], q: np.ndarray, p: np.ndarray,
                   rng: np.random.Generator, base_length: int = 0) -> Verdict:
    """Lossless speculative sampling.

    Args:
        draft_tokens: [k] ids drawn from q.
        q: [k, vocab] draft distribution at each window position.
        p: [k+1, vocab] target distribution (same warping as q).
        rng: the target side's generator.
    """
    for j, token in enumerate(draft_tokens):
        pj, qj = p[j, token], q[j, token]
        if qj > 0 and rng.random() * qj < pj:  # accept with min(1, p/q), no division
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        total = residual.sum()
        # total == 0 only if p == q exactly, where rejection has probability 0; fall back to p
        correction = sample(residual / total if total > 0 else p[j], rng)
        return Verdict(base_length, j, correction)
    return Verdict(base_length, len(draft_tokens), sample(p[len(draft_tokens)], rng))
