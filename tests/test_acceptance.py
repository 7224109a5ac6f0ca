"""The acceptance rule: exact greedy cases and the lossless sampling guarantee."""

import math

import numpy as np
import pytest

from mirror_rt.runtime.acceptance import Verdict, accept_greedy, accept_sampled
from mirror_rt.runtime.sampling import sample


def scripted_logits(argmaxes, vocab=10):
    """Logits [len, vocab] whose rows argmax to the given tokens (vLLM-style script)."""
    logits = np.zeros((len(argmaxes), vocab))
    logits[np.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


@pytest.mark.parametrize("draft,target,accepted,next_token", [
    ([5, 7, 9], [5, 7, 9, 4], 3, 4),  # full window: bonus
    ([5, 7, 9], [5, 7, 3, 4], 2, 3),  # late mismatch: correction
    ([5, 7, 9], [1, 7, 9, 4], 0, 1),  # first token rejected
    ([], [6], 0, 6),                   # empty draft: one plain target step
])
def test_greedy_cases(draft, target, accepted, next_token):
    verdict = accept_greedy(draft, scripted_logits(target), base_length=11)
    assert verdict == Verdict(11, accepted, next_token)


def chi2_threshold(dof: int, z: float = 4.753) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z=4.753 is the 1 - 1e-6 normal quantile."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def first_tokens(rule, p, q, n, seed):
    """Histogram of the first committed token over n one-token windows drafted from q."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(p.shape[1])
    for _ in range(n):
        d = sample(q[0], rng)
        verdict = rule([d], q, p, rng)
        counts[d if verdict.num_accepted else verdict.next_token] += 1
    return counts


def chi2(counts, expected_p):
    expected = expected_p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def random_dists(vocab, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.dirichlet(np.ones(vocab) * 0.7, size=rows)
    return x / x.sum(axis=1, keepdims=True)


def test_sampling_reproduces_target_distribution():
    """Committed tokens follow p, not q.

    Chi-square goodness of fit over an 8-token vocabulary (7 degrees of freedom) with 40k draws.
    The threshold is the chi-square 1 - 1e-6 quantile, so a correct rule fails with probability
    1e-6 per seed (and the seed is fixed, so the test is deterministic); the power check below
    shows the same threshold rejects a wrong rule by a wide margin.
    """
    p, q = random_dists(8, 2, seed=1), random_dists(8, 1, seed=2)
    counts = first_tokens(accept_sampled, p, q, 40_000, seed=3)
    assert chi2(counts, p[0]) < chi2_threshold(7)


def test_distribution_test_has_power():
    """Accepting every draft token (a wrong rule) yields q, which the same test rejects."""
    p, q = random_dists(8, 2, seed=1), random_dists(8, 1, seed=2)
    def always(draft, q_, p_, rng):
        return Verdict(0, len(draft), 0)
    counts = first_tokens(always, p, q, 40_000, seed=3)
    assert chi2(counts, p[0]) > 10 * chi2_threshold(7)


def test_sampling_window_positions_follow_target():
    """With a 2-token window, the second committed token (accepted or bonus/correction) follows p[1].

    p rows do not depend on earlier tokens here, so the second token's marginal must be p[1].
    Same 1e-6 chi-square threshold as above.
    """
    p, q = random_dists(6, 3, seed=4), random_dists(6, 2, seed=5)
    rng = np.random.default_rng(6)
    counts = np.zeros(6)
    for _ in range(40_000):
        draft = [sample(q[0], rng), sample(q[1], rng)]
        v = accept_sampled(draft, q, p, rng)
        if v.num_accepted == 0:
            continue  # the window ended after one token: no second token from this window
        counts[draft[1] if v.num_accepted == 2 else v.next_token] += 1
    assert chi2(counts, p[1]) < chi2_threshold(5)
