"""The verifier scores: one target forward over [last] + window, the acceptance rule, rollback.

Invariant: between steps the target cache holds the committed text except the last
token. `verify` feeds [last, d_1..d_k] (k+1 positions), takes the target's own choice at each
position (greedy argmax, or the draw at the position's uniform), accepts the drafts that equal them
(acceptance.accept_choices: lossless, and the same text as target-only decoding for any seed) and rolls
the cache back to committed-except-the-new-last, i.e. it keeps last and d_1..d_A.
"""

from __future__ import annotations

from collections.abc import Sequence

from mirror_rt.runtime.acceptance import Verdict, accept_choices
from mirror_rt.runtime.drafter import Draft
from mirror_rt.runtime.reference import choose_under, prefill_logits
from mirror_rt.runtime.sampling import SamplingConfig, choose_at
from mirror_rt.runtime.token_rules import TokenRules, settle, verify_rows


class Verifier:
    """Owns the target model's cache and random generator."""

    def __init__(self, target, sampling: SamplingConfig, seed: int = 0, cache=None, rules: TokenRules | None = None):
        self.target = target
        self.sampling = sampling
        self.rules = rules  # the sequence's token rules, at the committed text between steps
        self.seed = seed  # the request's: the token at each position is the target's draw at that position
        self.cache = cache  # None: `prefill` makes one

    def prefill(self, prompt: Sequence[int], capacity: int) -> int:
        """Run the prompt; returns the first generated token."""
        self.cache = self.cache or self.target.new_cache(capacity)
        logits = prefill_logits(self.target, prompt, self.cache)
        return choose_under(self.rules, logits, self.sampling, self.seed, len(prompt))

    def verify(self, last_token: int, draft: Draft) -> Verdict:
        """Score `draft` in one target forward and decide what to commit (draft.base_length: the committed
        length, so the window's first token is at that position)."""
        base = self.cache.length
        logits = self.target.forward([last_token] + draft.tokens, self.cache)  # [k+1, vocab]
        verdict = verify_window(self.rules, logits, draft.tokens, self.sampling, self.seed, draft.base_length)
        self.cache.rollback(base + 1 + verdict.num_accepted)
        return verdict


def verify_window(rules: TokenRules | None, logits, tokens: list[int], sampling: SamplingConfig, seed: int,
                  length: int):
    """The verdict on a window `tokens` [k] from the target's raw logits [k+1, vocab] over [last] + tokens:
    the target's own choice at each position (under `rules`, processed at committed + window[:j], which then
    settle at the committed text), the drafts equal to them accepted (`length`: the window's first position)."""
    rows, kept, advanced = verify_rows(rules, logits, tokens)
    choices = choose_at(rows, sampling, seed, length)  # [k'+1] the target's own
    verdict = accept_choices(kept, choices, length)
    settle(rules, advanced, kept, verdict, logits)
    return verdict
