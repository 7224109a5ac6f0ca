"""Logit warping: temperature, top-k, top-p."""

import numpy as np
import pytest

from mirror_rt.runtime.sampling import SamplingConfig, choose, probabilities


def test_top_k_keeps_k_tokens():
    p = probabilities(np.array([[1.0, 3.0, 2.0, 0.0]]), SamplingConfig(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and p[0, 1] > p[0, 2] > 0


def test_top_p_keeps_smallest_covering_set():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    assert np.allclose(p, [[0.625, 0.375, 0, 0]])


def test_greedy_is_argmax_without_probs():
    token, probs = choose(np.array([0.1, 2.0, 1.0]), SamplingConfig(), np.random.default_rng(0))
    assert token == 1 and probs is None


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(temperature=float("nan"))])
def test_invalid_settings_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)
