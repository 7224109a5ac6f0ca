"""Vanilla speculative decoding (sd) through the batched decoder equals the reference decoder token for token."""

import numpy as np
import pytest
from conftest import decode, decode_many, flat, perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.sampling import SamplingConfig


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_reference(seed, gamma):
    """Noisy draft (partial acceptance): output identical to target-only greedy."""
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 100)
    prompt = [(seed * 7 + i * 13) % 95 + 2 for i in range(5 + seed)]
    expected = flat(generate(TorchModel(target), prompt, 40))
    got = decode(TorchModel(target), TorchModel(draft), prompt, max_new_tokens=40, gamma=gamma)
    assert got.tokens == expected
    assert sum(got.stats["accept_lengths"]) == len(got.tokens) - 1  # every step commits accepted + 1


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_several_sequences_each_equal_their_reference(max_num_seqs):
    """Five prompts of different lengths, one row at a time or three at once: each text equals its own ar."""
    target = tiny_target(seed=1)
    draft = perturbed_copy(target, noise=0.4, seed=101)
    prompts = [[(i * 11 + j * 7) % 95 + 2 for j in range(3 + 2 * i)] for i in range(5)]
    got = decode_many(TorchModel(target), TorchModel(draft), prompts, max_num_seqs, max_new_tokens=30, gamma=3)
    assert [g.tokens for g in got] == [flat(generate(TorchModel(target), p, 30)) for p in prompts]


def test_noisy_draft_has_partial_acceptance():
    """The equality above is not vacuous: the draft is sometimes wrong and sometimes right."""
    target = tiny_target(seed=0)
    draft = perturbed_copy(target, noise=0.4, seed=100)
    stats = decode(TorchModel(target), TorchModel(draft), [5, 6, 7], max_new_tokens=60, gamma=4).stats
    assert 1.0 < stats["mean_accepted_length"] < 5.0


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_oracle_draft_fully_accepted(gamma):
    """With the target as its own draft (no draft model: the oracle) every window is fully accepted."""
    target = tiny_target(seed=2)
    got = decode(TorchModel(target), None, [3, 4, 5], max_new_tokens=50, gamma=gamma)
    assert got.tokens == flat(generate(TorchModel(target), [3, 4, 5], 50))
    lengths = got.stats["accept_lengths"]
    assert lengths[:-1] == [gamma + 1] * (len(lengths) - 1)


def test_context_limit_respected():
    """Generation stops when prompt + generated reaches the context; AR and SD agree."""
    target = TorchModel(tiny_target(seed=4))  # max_seq_len 256
    prompt = list(range(2, 96)) * 2 + list(range(2, 62))  # 248 tokens
    expected = flat(generate(target, prompt, 100))
    got = decode(target, TorchModel(tiny_target(seed=4)), prompt, max_new_tokens=100, gamma=4)
    assert len(expected) == 256 - len(prompt) and got.tokens == expected


def test_sampling_equals_reference_and_is_seeded():
    """Sampling, exact-seed: the target's own draws (the reference's, seed for seed); a different seed differs."""
    target = tiny_target(seed=5, scale=3.0)
    draft = perturbed_copy(target, noise=0.3, seed=9)
    s = SamplingConfig(temperature=1.0)

    def run(seed):
        return decode(TorchModel(target), TorchModel(draft), [4, 5], max_new_tokens=30, gamma=3, sampling=s,
                      seed=seed, sampling_verify="exact-seed").tokens

    assert run(1) == flat(generate(TorchModel(target), [4, 5], 30, s, 1)) and run(1) != run(2)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_rejection_sampling_is_seeded_and_accepts_more_than_exact_seed(mode):
    """Sampling, rejection (the default): a seed repeats its text, alone or beside other requests; over 4 seeds
    it accepts more draft tokens per window than the exact-seed coupling with the same draft (the acceptance
    rates themselves are proven in test_acceptance)."""
    target = tiny_target(seed=5, scale=3.0)
    draft = perturbed_copy(target, noise=0.3, seed=9)
    models = lambda: (TorchSplitTarget(target) if mode == "mirror" else TorchModel(target), TorchModel(draft))  # noqa: E731
    options = dict(mode=mode, max_new_tokens=40, gamma=4, sampling=SamplingConfig(temperature=0.8))

    def run(seed, rule):
        return decode(*models(), [4, 5], seed=seed, sampling_verify=rule, **options)

    once, crowded = run(1, "rejection"), decode_many(*models(), [[7, 8, 9], [4, 5]], 2, seed=1, **options)[1]
    assert once.tokens == run(1, "rejection").tokens == crowded.tokens != run(2, "rejection").tokens
    accepted = {rule: [a for seed in range(4) for a in run(seed, rule).stats["accept_lengths"]]
                for rule in ("rejection", "exact-seed")}
    assert np.mean(accepted["rejection"]) > np.mean(accepted["exact-seed"])


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_rejection_sampling_records_the_targets_logprobs(mode):
    """Under rejection sampling the committed tokens' log-probabilities are the target's at their positions (the
    raw rows of a plain forward over the text), whatever the draft proposed."""
    from mirror_rt.runtime.logprobs import token_logprobs
    from mirror_rt.runtime.token_rules import RulesConfig, TokenRules

    target = tiny_target(seed=5, scale=3.0)
    draft = perturbed_copy(target, noise=0.3, seed=9)
    model = TorchModel(target)
    rules = TokenRules(RulesConfig(logprobs=2), model.vocab_size, None, [4, 5])
    got = decode(TorchSplitTarget(target) if mode == "mirror" else model, TorchModel(draft), [4, 5], rules=rules,
                 mode=mode, max_new_tokens=24, gamma=4, sampling=SamplingConfig(temperature=0.8), seed=3)
    text = [4, 5] + got.tokens
    rows = model.forward(text[:-1], model.new_cache(len(text)))[1:]  # row i predicts got.tokens[i]
    expected = token_logprobs(rows, got.tokens, 2)
    assert [e.token for e in rules.logprobs] == got.tokens and max(got.stats["accept_lengths"]) > 1
    assert np.allclose([e.logprob for e in rules.logprobs], [e.logprob for e in expected], atol=1e-6)
    assert [[i for i, _ in e.top] for e in rules.logprobs] == [[i for i, _ in e.top] for e in expected]
