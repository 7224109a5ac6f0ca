"""The acceptance rule: exact greedy cases, the one matching loop, the target's own draws under sampling (exact-seed)
and standard speculative sampling (rejection): the target's distribution, and at least the coupling's acceptance."""

import math

import numpy as np
import pytest

from mirror_rt.runtime.acceptance import Verdict, matched, verify
from mirror_rt.runtime.sampling import (
    ACCEPTANCE,
    DRAFT_DRAWS,
    TARGET_DRAWS,
    SamplingConfig,
    choose_at,
    draw_at,
    position_uniform,
    probabilities,
)

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


# --- rejection sampling (standard speculative sampling) ------------------------------------------

def drafted(q_logits, draft_sampling, seed, length):
    """A window drafted as the draft row drafts under rejection sampling: its own draws (stream DRAFT_DRAWS) and
    the q rows they came from."""
    ids, q = draw_at(q_logits, draft_sampling, seed, length, DRAFT_DRAWS)
    return ids, list(q)


def rejection_runs(p_logits, q_logits, sampling, trials, one_hot=()):
    """`trials` seeded verdicts of windows drafted from q_logits [k, vocab] against p_logits [k+1, vocab]; the
    window positions in `one_hot` carry no q row (a forced or guessed token: a one-hot q)."""
    verdicts = []
    for seed in range(trials):
        window, q = drafted(q_logits, sampling, seed, 30)
        q = [None if j in one_hot else row for j, row in enumerate(q)]
        verdict = verify(p_logits, window, 30, sampling, seed, q=q)
        verdicts.append((window, verdict))
    return verdicts


def chi2(counts, probs) -> float:
    """Pearson's statistic of `counts` against `probs` over the tokens `probs` allows (the others must be 0)."""
    n, allowed = counts.sum(), probs > 0
    assert counts[~allowed].sum() == 0
    expected = probs[allowed] * n
    return float(((counts[allowed] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("sampling,one_hot", [(SamplingConfig(temperature=0.7, top_k=6, top_p=0.95), ()),
                                              (SamplingConfig(temperature=0.9, min_p=0.15), ()),
                                              (SamplingConfig(temperature=1.0), (1,))])
def test_rejection_sampling_commits_the_targets_distribution(sampling, one_hot):
    """Rejection sampling's committed tokens follow the target's warped p, position by position, not the draft's q.

    Windows of 2 over an 8-token vocabulary; p and q fixed per position (so the token committed at offset j, when
    the verdict reaches it, has the law p_j whatever came before). 4,000 seeded verdicts; per offset a
    chi-square goodness-of-fit test at the 1 - 1e-6 quantile of its degrees of freedom (the allowed tokens
    minus 1): a correct rule fails each with probability 1e-6, so this test falsely fails with probability at
    most 3e-6 (three statistics, union bound), and its seeds are fixed, so it is deterministic. The same
    statistic against q (power) must exceed ten times the threshold: the draft's law is told apart. With a one-hot
    q (a token drafted without probabilities: grammar-forced or guessed), the residual is p without that token.
    """
    p_logits = np.log(random_dists(8, 3, seed=3))  # [k+1, vocab] for a window of 2
    q_logits = np.log(random_dists(8, 2, seed=4))
    p = probabilities(p_logits, sampling).numpy()
    q = probabilities(q_logits, sampling).numpy()
    runs = rejection_runs(p_logits, q_logits, sampling, 4_000, one_hot)
    committed = [window[:v.num_accepted] + [v.next_token] for window, v in runs]
    for offset in range(3):
        counts = np.bincount([c[offset] for c in committed if len(c) > offset], minlength=8)
        dof = int((p[offset] > 0).sum()) - 1
        assert chi2(counts, p[offset]) < chi2_threshold(dof), offset
        if offset < 2 and offset not in one_hot:
            draft_fit = float(((counts - q[offset] * counts.sum()) ** 2 / (q[offset] * counts.sum() + 1e-12)).sum())
            assert draft_fit > 10 * chi2_threshold(dof)
    assert 0 < np.mean([v.num_accepted for _, v in runs]) < 2  # both corrections and bonus tokens were drawn


def expected_accepted(p, q) -> float:
    """E[accepted] of a window under standard speculative sampling: sum over j of prod_{i<=j} (1 - TV(p_i, q_i))."""
    rates = np.minimum(p[:len(q)], q).sum(-1)
    return float(np.cumprod(rates).sum())


def test_rejection_accepts_at_least_the_coupling_on_the_same_windows():
    """On the same target and draft distributions, mean accepted over 1,500 seeds: rejection sampling >= the
    exact-seed coupling (whose draft draws at the target's own uniform), and rejection's mean is the theory's
    sum_j prod_{i<=j} sum_x min(p_i, q_i) within 5 standard errors (a false failure well below 1e-5)."""
    sampling = SamplingConfig(temperature=0.8)
    p_logits = np.log(random_dists(12, 5, seed=7))  # a window of 4
    q_logits = p_logits[:4] + np.random.default_rng(8).normal(0, 1.0, size=(4, 12))  # a draft close to the target
    rejection = [v.num_accepted for _, v in rejection_runs(p_logits, q_logits, sampling, 1_500)]
    coupled = []
    for seed in range(1_500):
        window = choose_at(q_logits, sampling, seed, 30)  # the coupling's draft: the target's uniform
        coupled.append(verify(p_logits, window, 30, sampling, seed).num_accepted)
    p, q = probabilities(p_logits, sampling).numpy(), probabilities(q_logits, sampling).numpy()
    theory = expected_accepted(p, q)
    assert abs(np.mean(rejection) - theory) < 5 * np.std(rejection) / np.sqrt(len(rejection))
    assert np.mean(rejection) >= np.mean(coupled)


@pytest.mark.parametrize("draft,target,accepted,next_token", [([5, 7, 9], [5, 7, 9, 4], 3, 4),
                                                              ([5, 7, 9], [5, 7, 3, 4], 2, 3),
                                                              ([5, 7, 9], [1, 7, 9, 4], 0, 1)])
def test_greedy_ignores_draft_distributions(draft, target, accepted, next_token):
    """Greedy: with or without q rows (and any q), both rules are argmax matching."""
    q = [np.full(10, 0.1), None, np.eye(10)[2]]
    verdict = verify(scripted_logits(target), draft, 11, GREEDY, seed=0, q=q)
    assert verdict == Verdict(11, accepted, next_token) == verify(scripted_logits(target), draft, 11, GREEDY, 0)


def test_rejection_keeps_a_draft_equal_to_the_target_and_never_corrects_to_the_rejected_token():
    """q = p: every token is accepted (min(1, p/q) = 1) and the bonus is the draft's own guess past the window
    (drawn at the same uniform: Mirror reuses its line); a rejected token never comes back as its own correction
    (the residual max(0, p - q) is 0 there)."""
    sampling = SamplingConfig(temperature=1.0)
    logits = np.log(random_dists(6, 4, seed=11))
    for seed in range(200):
        line, q = drafted(logits, sampling, seed, 0)  # the window and the guess past it
        assert verify(logits, line[:3], 0, sampling, seed, q=q[:3]) == Verdict(0, 3, line[3])
        skewed = np.log(random_dists(6, 3, seed=seed + 100))
        window, q = drafted(skewed, sampling, seed, 0)
        verdict = verify(logits, window, 0, sampling, seed, q=q)
        assert verdict.num_accepted == 3 or verdict.next_token != window[verdict.num_accepted]


def test_the_draft_streams_are_independent_of_the_targets():
    """Three uniforms per position (target draws, draft draws, acceptance); stream 0 is the one ar has always
    drawn with, so exact-seed text is unchanged."""
    streams = [[position_uniform(3, n, s) for n in range(200)] for s in (TARGET_DRAWS, DRAFT_DRAWS, ACCEPTANCE)]
    assert streams[0] == [position_uniform(3, n) for n in range(200)]
    assert abs(np.corrcoef(streams)[np.triu_indices(3, 1)]).max() < 0.3
