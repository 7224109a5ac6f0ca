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

from mirror_rt.runtime.lazy_torch import import_torch, is_tensor
from mirror_rt.runtime.sampling import as_tensor, greedy_ids, sample
from mirror_rt.runtime.transfer import host_floats


@dataclass(frozen=True)
class Verdict:
    """The target's decision on one window."""

    base_length: int  # committed length the window continued from (alignment check)
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # correction if a token was rejected, bonus if all were accepted
    # committed tokens = window[:num_accepted] + [next_token]


def accept_greedy(draft_tokens: Sequence[int], target_logits, base_length: int = 0) -> Verdict:
    """Longest-prefix match against the target's argmax.

    Args:
        draft_tokens: [k] proposed ids.
        target_logits: [k+1, vocab] target logits over [last, d_1..d_k] (host array or device tensor);
            only their k+1 argmax ids are read back.
    Example:
        draft [5, 7, 9], target argmax rows [5, 7, 3, 4] -> accepted 2, correction 3.
    """
    target = greedy_ids(target_logits)  # [k+1]
    k = len(draft_tokens)
    n = 0
    while n < k and draft_tokens[n] == target[n]:
        n += 1
    return Verdict(base_length, n, target[n])


def accept_choices(draft_tokens: Sequence[int], target_ids: Sequence[int], base_length: int = 0) -> Verdict:
    """Coupled verification: accept the longest prefix of draft tokens equal to the target's own choices.

    Args:
        draft_tokens: [k] proposed ids.
        target_ids: [k+1] the target's choice after [last, d_1..d_k] (runtime.sampling.choose_at: the argmax, or
            the draw at each position's own uniform), so the committed tokens are exactly the target's.
    Example:
        draft [5, 7, 9], target choices [5, 7, 3, 4] -> accepted 2, correction 3.
    """
    k = len(draft_tokens)
    n = 0
    while n < k and draft_tokens[n] == target_ids[n]:
        n += 1
    return Verdict(base_length, n, int(target_ids[n]))


def accept_sampled(draft_tokens: Sequence[int], q, p, rng: np.random.Generator, base_length: int = 0) -> Verdict:
    """Lossless speculative sampling, computed where p lives.

    Args:
        draft_tokens: [k] ids drawn from q.
        q: [k, vocab] draft distribution at each window position (host array or tensor).
        p: [k+1, vocab] target distribution (same warping as q), on the target's device.
        rng: the target side's generator (host uniforms: the same draws on every device).
    Reads back p and q at the k drafted tokens, then one id (the correction or the bonus).
    """
    torch = import_torch()
    count = is_tensor(p)
    p, k = as_tensor(p), len(draft_tokens)
    q = as_tensor(q).to(p.device) if k else None
    if k:
        rows = torch.arange(k, device=p.device)
        ids = torch.as_tensor(list(draft_tokens), device=p.device)
        p_drafted, q_drafted = host_floats(p[rows, ids], count), host_floats(q[rows, ids], count)
    for j in range(k):
        pj, qj = p_drafted[j], q_drafted[j]
        if qj > 0 and rng.random() * qj < pj:  # accept with min(1, p/q), no division
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        # an all-zero residual only if p == q exactly, where rejection has probability 0; fall back to p
        correction = sample(torch.where(residual.sum() > 0, residual, p[j]), rng, count)
        return Verdict(base_length, j, correction)
    return Verdict(base_length, k, sample(p[k], rng, count))
