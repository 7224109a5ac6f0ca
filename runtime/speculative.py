"""Vanilla (serial) speculative decoding: propose -> verify -> commit, one window at a time.

The draft and target take turns, so each step costs T_draft(k) + T_target(k+1). This is
the `sd` mode and the baseline the Mirror orchestrator must beat; it is also the sync
reference for pipelined modes. It yields the committed tokens of each step; text-level
stop conditions (EOS, stop strings) belong to the caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mirror_rt.runtime.drafter import ModelDrafter
from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.reference import adopts_target_kv, token_budget
from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.runtime.token_rules import TokenRules
from mirror_rt.runtime.verifier import Verifier


def speculative_generate(target, draft, prompt: Sequence[int], max_new_tokens: int, gamma: int,
                         sampling: SamplingConfig | None = None, seed: int = 0,
                         metrics: Metrics | None = None, rules: TokenRules | None = None) -> Iterator[list[int]]:
    """Yield the tokens committed at each step (accepted + correction or bonus); greedy when `sampling` is None.

    `rules` (grammar, bias, penalties, logprobs) process the target's rows; the draft proposes under a fork.
    """
    sampling = sampling or SamplingConfig()
    metrics = metrics or Metrics()
    budget = token_budget(len(prompt), max_new_tokens, target.max_seq_len)
    if budget == 0:
        return
    capacity = len(prompt) + budget
    draft_rules = rules.fork() if rules is not None and rules.changes_logits else None
    verifier = Verifier(target, sampling, seed, rules=rules)
    drafter = ModelDrafter(draft, sampling, seed, draft_rules)
    with metrics.stage("target_prefill"):
        last = verifier.prefill(prompt, capacity)
    with metrics.stage("draft_prefill"):
        if adopts_target_kv(draft):
            drafter.adopt(verifier.cache, capacity)  # the target's copy starts from the target's prompt KV
        else:
            drafter.prefill(prompt, capacity)
    if draft_rules is not None:
        draft_rules.accept(last)
    produced = 1
    metrics.durations["draft_forward"] = drafter.forward_seconds  # filled as the draft runs
    yield [last]
    while produced < budget:
        # Phase 0: how far to speculate (never past the budget, so never past the cache)
        k = min(gamma, budget - produced - 1)
        # Phase 1: the draft proposes k tokens after the last committed one
        with metrics.stage("draft_propose"):
            draft = drafter.propose(last, k, len(prompt) + produced)
        # Phase 2: the target scores [last] + window in one forward and decides
        with metrics.stage("target_verify" if k else "target_forward"):  # a window of 0 is a plain step
            verdict = verifier.verify(last, draft)
        # Phase 3: the draft rolls back to the accepted prefix
        drafter.commit(verdict)
        tokens = draft.tokens[:verdict.num_accepted] + [verdict.next_token]
        metrics.record_step(k, verdict.num_accepted)
        produced += len(tokens)
        last = verdict.next_token
        yield tokens
