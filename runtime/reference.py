"""The reference decoder: plain autoregressive decoding with the target alone, the oracle of every equality test.

It yields committed tokens one step at a time and stops after `max_new_tokens` or when the context is full; stop
conditions on text (EOS, stop strings) belong to the caller.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.sampling import SamplingConfig, choose_at
from mirror_rt.runtime.token_rules import TokenRules


def token_budget(prompt_length: int, max_new_tokens: int, max_seq_len: int) -> int:
    """Tokens that may be generated: prompt + generated never exceeds the context."""
    return max(0, min(max_new_tokens, max_seq_len - prompt_length))


def generate(target, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
             seed: int = 0, metrics: Metrics | None = None, rules: TokenRules | None = None) -> Iterator[list[int]]:
    """Yield [token] per step: the target's own continuation of `prompt` (greedy when `sampling` is None),
    under `rules` (grammar, bias, penalties, logprobs) when given."""
    sampling = sampling or SamplingConfig()
    metrics = metrics or Metrics()
    budget = token_budget(len(prompt), max_new_tokens, target.max_seq_len)
    if budget == 0:
        return
    cache = target.new_cache(len(prompt) + budget)
    with metrics.stage("target_prefill"):
        logits = target.forward_last(prompt, cache)[-1]
    position = len(prompt)  # the token's index in prompt + output: its draw (runtime.sampling.position_uniform)
    token = choose_under(rules, logits, sampling, seed, position)
    yield [token]
    for _ in range(budget - 1):
        with metrics.stage("target_forward"):
            logits = target.forward([token], cache)
        position += 1
        token = choose_under(rules, logits[-1], sampling, seed, position)
        metrics.record_step(0, 0)
        yield [token]


def choose_under(rules: TokenRules | None, logits, sampling: SamplingConfig, seed: int, position: int) -> int:
    """The target's token at `position` from one raw logits row [vocab] under `rules`, which then accept and
    record it (its log-probability from the raw row)."""
    if rules is None:
        return choose_at(logits, sampling, seed, position)[0]
    token = choose_at(rules.apply(logits), sampling, seed, position)[0]
    rules.accept(token)
    rules.record(logits[None], [token])
    return token
