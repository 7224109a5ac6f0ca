"""The verifier scores: one target forward over [last] + window, the acceptance rule, rollback.

Invariant: between steps the target cache holds the committed text except the last
token. `verify` feeds [last, d_1..d_k] (k+1 positions), applies `acceptance`, and rolls
the cache back to committed-except-the-new-last, i.e. it keeps last and d_1..d_A.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mirror_rt.runtime.acceptance import Verdict, accept_greedy, accept_sampled
from mirror_rt.runtime.drafter import Draft
from mirror_rt.runtime.reference import choose_under, prefill_logits
from mirror_rt.runtime.sampling import SamplingConfig, probabilities
from mirror_rt.runtime.token_rules import TokenRules, settle, verify_rows


class Verifier:
    """Owns the target model's cache and random generator."""

    def __init__(self, target, sampling: SamplingConfig, seed: int = 0, rules: TokenRules | None = None):
        self.target = target
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)
        self.rules = rules  # the sequence's token rules, at the committed text between steps
        self.cache = None

    def prefill(self, prompt: Sequence[int], capacity: int) -> int:
        """Run the prompt; returns the first generated token."""
        self.cache = self.target.new_cache(capacity)
        return choose_under(self.rules, prefill_logits(self.target, prompt, self.cache), self.sampling, self.rng)

    def verify(self, last_token: int, draft: Draft) -> Verdict:
        """Score `draft` in one target forward and decide what to commit."""
        base = self.cache.length
        logits = self.target.forward([last_token] + draft.tokens, self.cache)  # [k+1, vocab]
        rows, tokens, advanced = verify_rows(self.rules, logits, draft.tokens)  # processed by the rules
        if self.sampling.greedy:
            verdict = accept_greedy(tokens, rows, draft.base_length)
        else:
            p = probabilities(rows, self.sampling)  # [k+1, vocab]
            verdict = accept_sampled(tokens, draft.q, p, self.rng, draft.base_length)
        self.cache.rollback(base + 1 + verdict.num_accepted)
        settle(self.rules, advanced, tokens, verdict, logits)  # the rules roll back with the cache
        return verdict
