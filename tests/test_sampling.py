"""Logit warping: temperature, min-p, top-k, top-p."""

import numpy as np
import pytest

from mirror_rt.runtime.sampling import SamplingConfig, choose_at, probabilities


def test_top_k_keeps_k_tokens():
    p = probabilities(np.array([[1.0, 3.0, 2.0, 0.0]]), SamplingConfig(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and p[0, 1] > p[0, 2] > 0


def test_top_p_keeps_smallest_covering_set():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    assert np.allclose(p, [[0.625, 0.375, 0, 0]])


@pytest.mark.parametrize("temperature,kept", [(1.0, 3), (2.0, 4), (0.5, 2)])
def test_min_p_keeps_tokens_near_the_likeliest_after_temperature(temperature, kept):
    """vLLM's order: min-p reads the tempered distribution. p = (0.5, 0.3, 0.15, 0.05), min-p 0.2 keeps p >= 0.1:
    three tokens at temperature 1, all four at 2 (0.05 ** 0.5 / 0.5 ** 0.5 = 0.32), two at 0.5 (0.15 ** 2 / 0.25)."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    tempered = probabilities(logits, SamplingConfig(temperature=temperature)).numpy()
    p = probabilities(logits, SamplingConfig(temperature=temperature, min_p=0.2)).numpy()
    assert np.count_nonzero(p) == kept and np.isclose(p.sum(), 1)
    assert np.allclose(p[0, :kept], tempered[0, :kept] / tempered[0, :kept].sum())
    assert np.array_equal(probabilities(logits, SamplingConfig(temperature=temperature, min_p=0.0)).numpy(), tempered)


def test_min_p_one_keeps_the_likeliest_tokens_only():
    p = probabilities(np.array([[1.0, 3.0, 3.0, 2.0]]), SamplingConfig(temperature=1.3, min_p=1.0)).numpy()
    assert np.allclose(p, [[0, 0.5, 0.5, 0]])


def test_greedy_is_argmax():
    assert choose_at(np.array([0.1, 2.0, 1.0]), SamplingConfig(), 0, 0) == [1]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """5e-324 overflowed the logits to inf and drew token 0 at every position."""
    config = SamplingConfig(temperature=temperature)
    assert config.greedy and choose_at(np.array([0.1, 2.0, 1.0]), config, 7, 0) == [1]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(temperature=float("nan")), dict(min_p=-0.1), dict(min_p=1.5),
                                    dict(min_p=float("nan")), dict(min_p="0.1")])
def test_invalid_settings_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_greedy_ids_of_host_arrays_break_ties_as_torch(dtype):
    """Host arrays take numpy's argmax (no torch): ties go to the first maximum, as torch's argmax does."""
    import torch

    from mirror_rt.runtime.sampling import choose_at, greedy_ids

    rows = np.random.default_rng(0).integers(-3, 3, size=(6, 50)).astype(dtype)  # many ties
    rows[2] = -np.inf
    rows[3, [4, 9]] = np.inf
    expected = torch.from_numpy(rows).argmax(-1).tolist()
    assert greedy_ids(rows) == expected == choose_at(rows, SamplingConfig(), 1, 0)
    assert greedy_ids(rows[1]) == [expected[1]] == greedy_ids(torch.from_numpy(rows[1]))
