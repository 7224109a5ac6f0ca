"""The acceptance rule: the target's logits over a window in, the `Verdict` out. Pure: no model, no cache, no I/O.

Notation: **p = target probabilities, q = draft probabilities**. The drafts equal to the target's own choices
(runtime.sampling.choose_at) are accepted, then the **correction** or the **bonus**: the committed tokens are
exactly the target's, for any seed. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mirror_rt.runtime.sampling import SamplingConfig, choose_at
from mirror_rt.runtime.token_rules import TokenRules, settle, verify_rows


@dataclass(frozen=True)
class Verdict:
    """The target's decision on one window."""

    base_length: int  # committed length the window continued from (alignment check)
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # correction if a token was rejected, bonus if all were accepted
    # committed tokens = window[:num_accepted] + [next_token]


def matched(proposed: Sequence[int], choices: Sequence[int]) -> int:
    """How many leading `proposed` tokens equal `choices` (the one acceptance loop: windows, prompt-lookup and SS
    stream guesses). Example: proposed [5, 7, 9], choices [5, 7, 3, 4] -> 2."""
    n = 0
    while n < len(proposed) and proposed[n] == choices[n]:
        n += 1
    return n


def verify(logits, window: list[int], length: int, sampling: SamplingConfig, seed: int,
           rules: TokenRules | None = None) -> Verdict:
    """The verdict on `window` [k] from the target's raw logits [k+1, vocab] over [last] + window, whose first
    token is at position `length` (the committed length). Under `rules` (the sequence's, at the committed text)
    row j is processed at the committed text plus window[:j]; the rules then end at the committed text plus the
    verdict's tokens, whose log-probabilities they record. Example: window [5, 7, 9], the target's choices
    [5, 7, 3, 4] -> accepted 2, correction 3."""
    rows, window, advanced = verify_rows(rules, logits, window)
    choices = choose_at(rows, sampling, seed, length)  # [k'+1] the target's own
    accepted = matched(window, choices)
    verdict = Verdict(length, accepted, int(choices[accepted]))
    settle(rules, advanced, window, verdict, logits)
    return verdict
