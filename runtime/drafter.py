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

    def __init__(self, draft, sampling: SamplingConfig, seed: int = 0):
        self.draft = draft
        self.sampling = sampling
        self.seed = seed  # the request's: draws are keyed by (seed, position), shared with the target
        self.cache = None
        self.pending: list[int] = []  # committed tokens not yet in the draft cache
        self.window: list[int] = []  # the last proposal (needed by commit)
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
        """k draft tokens after `last_token` (k forwards; the first also feeds pending tokens)."""
        tokens = []
        feed = self.pending + [last_token]
        for _ in range(k):
            t0 = time.perf_counter()
            logits = self.draft.forward(feed, self.cache)
            self.forward_seconds.append(time.perf_counter() - t0)
            # the draft draws with the target's uniform at that position: it proposes the target's choice
            # wherever their distributions agree (coupled verification, runtime.acceptance.accept_choices)
            token = choose_at(logits[-1], self.sampling, self.seed, base_length + len(tokens))[0]
            tokens.append(token)
            feed = [token]
        self.pending = [] if k else self.pending + [last_token]
        self.window = tokens
        return Draft(base_length, tokens, None)

    def commit(self, verdict: Verdict) -> None:
        """Roll the draft cache back to the accepted prefix of the last window."""
        k, n = len(self.window), verdict.num_accepted
        if k == 0:
            return
        fed = self.cache.length  # holds ... last, d_1 .. d_{k-1}
        if n < k:
            self.cache.rollback(fed - (k - 1 - n))
        else:  # d_k was accepted but never fed
            self.pending = [self.window[-1]]
