"""`Generation.steps`: every decode step with its window (drafted k, accepted A), and where each token came from
(the first A accepted draft tokens, then the target's correction, bonus or own token)."""

from __future__ import annotations

import pytest

from mirror_rt.runtime.generation import ORIGINS, Step


@pytest.mark.parametrize("drafted, accepted, tokens, origins", [
    (0, 0, 1, ["target"]),
    (4, 2, 3, ["draft", "draft", "correction"]),
    (3, 0, 1, ["correction"]),
    (4, 4, 5, ["draft", "draft", "draft", "draft", "bonus"]),
])
def test_step_origins(drafted, accepted, tokens, origins):
    step = Step(0.0, tokens, drafted, accepted)
    assert [step.origin(i) for i in range(tokens)] == origins


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_steps_account_for_every_token_and_agree_with_the_stats(engine, mode):
    gen = engine.generate("hello there", mode=mode, max_new_tokens=40, ignore_eos=True)
    steps, stats = gen.steps, gen.stats
    assert sum(step.tokens for step in steps) == len(gen.tokens) == 40
    assert (steps[0].tokens, steps[0].drafted) == (1, 0)  # the prompt's first token: no window verified it
    assert [step.tokens for step in steps[1:]] == stats["accept_lengths"]
    assert sum(step.drafted for step in steps) == sum(stats["proposed_per_position"])
    origins = [step.origin(i) for step in steps for i in range(step.tokens)]
    assert set(origins) <= set(ORIGINS)
    assert origins.count("draft") == sum(stats["accepted_per_position"])
    assert all(step.tokens == step.accepted + 1 for step in steps)
    if mode == "ar":
        assert set(origins) == {"target"}
    else:  # the tiny pair's draft is a noisy copy: it is right often and wrong often
        assert {"draft", "correction"} <= set(origins)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_text_that_ends_inside_a_window_counts_only_what_it_delivered(mode):
    """A stop string (or an end-of-sequence) inside an accepted window: the window's tokens after it were never
    delivered, so the steps, the accepted counts and the per-token latencies stop there too."""
    import mirror_rt

    engine = mirror_rt.load("tiny", "tiny", log=lambda *a: None)  # the draft is the target: windows accepted whole
    text = engine.generate("hello", mode="ar", max_new_tokens=30, ignore_eos=True).text
    gen = engine.generate("hello", mode=mode, max_new_tokens=30, stop_strings=[text[5:8]], gamma=4)
    stats = gen.stats
    assert gen.stop_reason == "stop_string" and any(step.drafted for step in gen.steps)
    assert sum(step.tokens for step in gen.steps) == stats["new_tokens"]
    assert sum(stats["accepted_per_position"]) <= stats["new_tokens"] - 1  # the first token is the prompt's
    assert [step.tokens for step in gen.steps[1:]] == stats["accept_lengths"]
    assert sum(step.drafted for step in gen.steps) == sum(stats["proposed_per_position"])


def test_tokens_grow_while_the_generation_runs(engine):
    gen = engine.stream("hello there", mode="sd", max_new_tokens=20, ignore_eos=True)
    seen = [len(gen.tokens) for _ in gen]
    assert seen == sorted(seen) and seen[0] >= 1 and len(gen.tokens) == 20
