"""Vanilla speculative decoding equals the reference decoder (greedy) token for token."""

import pytest
from conftest import perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.speculative import speculative_generate


def flat(steps):
    return [t for step in steps for t in step]


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_reference(seed, gamma):
    """Noisy draft (partial acceptance): output identical to target-only greedy."""
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 100)
    prompt = [(seed * 7 + i * 13) % 95 + 2 for i in range(5 + seed)]
    expected = flat(generate(TorchModel(target), prompt, 40))
    metrics = Metrics()
    got = flat(speculative_generate(TorchModel(target), TorchModel(draft), prompt, 40, gamma, metrics=metrics))
    assert got == expected
    assert sum(metrics.accept_lengths) == len(got) - 1  # every step commits accepted + 1


def test_noisy_draft_has_partial_acceptance():
    """The equality above is not vacuous: the draft is sometimes wrong and sometimes right."""
    target = tiny_target(seed=0)
    draft = perturbed_copy(target, noise=0.4, seed=100)
    metrics = Metrics()
    flat(speculative_generate(TorchModel(target), TorchModel(draft), [5, 6, 7], 60, 4, metrics=metrics))
    assert 1.0 < metrics.committed / metrics.steps < 5.0


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_oracle_draft_fully_accepted(gamma):
    """With the target as its own draft every window is fully accepted."""
    target = tiny_target(seed=2)
    metrics = Metrics()
    got = flat(speculative_generate(TorchModel(target), TorchModel(target), [3, 4, 5], 50, gamma, metrics=metrics))
    assert got == flat(generate(TorchModel(target), [3, 4, 5], 50))
    assert metrics.accept_lengths[:-1] == [gamma + 1] * (len(metrics.accept_lengths) - 1)


def test_context_limit_respected():
    """Generation stops when prompt + generated reaches the context; AR and SD agree."""
    target = TorchModel(tiny_target(seed=4))  # max_seq_len 256
    prompt = list(range(2, 96)) * 2 + list(range(2, 62))  # 248 tokens
    expected = flat(generate(target, prompt, 100))
    got = flat(speculative_generate(target, TorchModel(tiny_target(seed=4)), prompt, 100, 4))
    assert len(expected) == 256 - len(prompt) and got == expected


def test_sampling_runs_and_is_seeded():
    """Sampling mode: same seed, same tokens; a different seed differs."""
    from mirror_rt.runtime.sampling import SamplingConfig

    target = tiny_target(seed=5, scale=3.0)
    draft = perturbed_copy(target, noise=0.3, seed=9)
    s = SamplingConfig(temperature=1.0)

    def run(seed):
        return flat(speculative_generate(TorchModel(target), TorchModel(draft), [4, 5], 30, 3, s, seed))

    assert run(1) == run(1) and run(1) != run(2)
