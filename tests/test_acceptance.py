"""The acceptance rule: exact greedy cases, the one matching loop, and the target's own draws under sampling."""

import math

import numpy as np
import pytest

from mirror_rt.runtime.acceptance import Verdict, matched, verify
from mirror_rt.runtime.sampling import SamplingConfig, choose_at

GREEDY = SamplingConfig()


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
    verdict = verify(scripted_logits(target), draft, 11, GREEDY, seed=0)
    assert verdict == Verdict(11, accepted, next_token)


@pytest.mark.parametrize("proposed,choices,n", [([5, 7, 9], [5, 7, 3, 4], 2), ([], [1], 0), ([2], [2, 3], 1),
                                                ([4, 4], [5, 4], 0)])
def test_matched_counts_the_leading_agreements(proposed, choices, n):
    assert matched(proposed, choices) == n


def chi2_threshold(dof: int, z: float = 4.753) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z=4.753 is the 1 - 1e-6 normal quantile."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def random_dists(vocab, rows, seed):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(vocab) * 0.7, size=rows)


def test_sampled_verdict_commits_the_targets_own_draws():
    """Under sampling every committed token is the target's draw at its position (`choose_at`), whatever the draft
    proposed: the accepted tokens are those equal to it, then the target's own at the first mismatch."""
    sampling = SamplingConfig(temperature=1.0)
    logits = np.log(random_dists(6, 4, seed=1))  # [k+1, vocab] for a window of 3
    own = choose_at(logits, sampling, 5, 20)  # positions 20..23
    for window in ([own[0], own[1], own[2]], [own[0], (own[1] + 1) % 6, own[2]], [(own[0] + 1) % 6, 0, 0]):
        verdict = verify(logits, window, 20, sampling, seed=5)
        assert window[:verdict.num_accepted] + [verdict.next_token] == own[:verdict.num_accepted + 1]


def test_sampling_reproduces_target_distribution():
    """The target's draws at successive positions follow p, not the draft's q.

    Chi-square goodness of fit over an 8-token vocabulary (7 degrees of freedom) with 40k positions. The threshold
    is the chi-square 1 - 1e-6 quantile, so a correct rule fails with probability 1e-6 (and the seed is fixed, so the
    test is deterministic); the power check shows the same threshold rejects q by a wide margin.
    """
    p, q = random_dists(8, 1, seed=1)[0], random_dists(8, 1, seed=2)[0]
    sampling = SamplingConfig(temperature=1.0)
    draws = choose_at(np.log(np.tile(p, (40_000, 1))), sampling, 3, 0)
    counts = np.bincount(draws, minlength=8)
    chi2 = lambda probs: float(((counts - probs * counts.sum()) ** 2 / (probs * counts.sum())).sum())  # noqa: E731
    assert chi2(p) < chi2_threshold(7) and chi2(q) > 10 * chi2_threshold(7)
