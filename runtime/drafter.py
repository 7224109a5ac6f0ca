"""The drafter proposes: k tokens continuing the committed text, with q when sampling.

`ModelDrafter` runs a draft model (a smaller model sharing the tokenizer, or the target
itself as the oracle draft) over its own KV cache. Invariant: between steps the draft cache
holds the committed text except the last token, minus `pending` tokens that were
accepted but not yet fed; they are fed together with `last` on the next proposal, so a
fully accepted window costs no extra forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mirror_rt.runtime.acceptance import Verdict
from mirror_rt.runtime.reference import prefill_logits
from mirror_rt.runtime.sampling import SamplingConfig, choose_at
from mirror_rt.runtime.token_rules import TokenRules


@dataclass(frozen=True)
class Draft:
    """A window proposed by the draft."""

    base_length: int  # committed length (prompt + generated) the window continues from
    tokens: list[int]  # [k] proposed ids
    q: object | None  # [k, vocab] draft distribution; None: coupled proposals (runtime.sampling.choose_at)


class ModelDrafter:
    """Proposes with a draft `LoadedModel`.

    Limitations:
    - batch size 1; the draft must share the target's tokenizer (ids are compared directly).
    """

    def __init__(self, draft, sampling: SamplingConfig, seed: int = 0, rules: TokenRules | None = None):
        self.draft = draft
        self.sampling = sampling
        self.seed = seed  # the request's: draws are keyed by (seed, position), shared with the target
        self.rules = rules  # the draft's own copy of the sequence's rules, at the committed text between steps
        self.cache = None
        self.pending: list[int] = []  # committed tokens not yet in the draft cache
        self.window: list[int] = []  # the last proposal (needed by commit)
        self.fed_from = 0  # cache length when the last proposal started
        self.sequence: list[int] = []  # pending + [last] + window: the tokens the last proposal continued
        self.forced = 0  # grammar-forced tokens proposed without a forward
        self.forward_seconds: list[float] = []  # wall time of each draft forward (metrics)

    def prefill(self, prompt: Sequence[int], capacity: int) -> None:
        """Fill the draft cache with the prompt."""
        self.cache = self.draft.new_cache(capacity)
        prefill_logits(self.draft, prompt, self.cache)
        self.pending = []

    def adopt(self, target_cache, capacity: int) -> None:
        """Start from the target's prompt KV (a draft that is the target's copy, see LoadedModel.adopt)."""
        self.cache = self.draft.adopt(target_cache, capacity)
        self.pending = []

    def propose(self, last_token: int, k: int, base_length: int) -> Draft:
        """k draft tokens after `last_token` (at most k forwards; the first also feeds pending tokens).

        Each token is the draft's draw at the target's uniform for its position, so it proposes the target's
        choice wherever their distributions agree (coupled verification, runtime.acceptance.accept_choices).
        Under rules the draft draws from its own processed logits, and a token the grammar forces is proposed
        without a forward (one at a time: a window is then a function of its context alone).
        """
        tokens = []
        feed = self.pending + [last_token]
        self.fed_from, self.sequence = self.cache.length, list(feed)
        while len(tokens) < k:
            forced = self.rules.forced()[:1] if self.rules is not None else []
            if forced:
                self.rules.accept(forced[0])
                self.forced += 1
                tokens += forced
                feed += forced
                continue
            t0 = time.perf_counter()
            logits = self.draft.forward(feed, self.cache)
            self.forward_seconds.append(time.perf_counter() - t0)
            row = logits[-1] if self.rules is None else self.rules.apply(logits[-1])
            token = choose_at(row, self.sampling, self.seed, base_length + len(tokens))[0]
            if self.rules is not None:
                self.rules.accept(token)
            tokens.append(token)
            feed = [token]
        self.window = tokens
        self.sequence += tokens
        return Draft(base_length, tokens, None)

    def commit(self, verdict: Verdict) -> None:
        """Roll the draft cache (and rules) back to the accepted prefix of the last window."""
        n = verdict.num_accepted
        keep = len(self.sequence) - len(self.window) + n  # pending, last and the accepted tokens
        fed = self.cache.length - self.fed_from  # of `sequence`, in the cache
        if fed > keep:
            self.cache.rollback(self.fed_from + keep)
        self.pending = self.sequence[min(fed, keep):keep]
        if self.rules is not None:
            self.rules.rollback(len(self.window) - n)
            self.rules.accept(verdict.next_token)
