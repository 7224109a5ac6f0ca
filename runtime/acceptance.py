"""The acceptance rule: the target's logits over a window in, the `Verdict` out. Pure: no model, no cache, no I/O.

Notation: **p = target probabilities, q = draft probabilities**. Greedy: the drafts equal to the target's argmax
are accepted, then the **correction** or the **bonus**. Sampling, two rules (`GenerationConfig.sampling_verify`):
- **rejection** (standard speculative sampling): d_j is accepted with probability min(1, p(d_j) / q(d_j)); the
  first rejected one is replaced by a correction drawn from norm(max(0, p - q)); after k accepted, a bonus drawn
  from p. The committed text has the target's distribution; the draft's q rows travel with its window (a token
  without one, grammar-forced, is a one-hot q).
- **exact-seed** (the coupling): the drafts equal to the target's own seeded draws (runtime.sampling.choose_at) are
  accepted: the committed tokens are exactly target-only's, for any seed; fewer are accepted.
Each acceptance test is its own uniform (`position_uniform`, stream ACCEPTANCE); a correction is drawn at the
target's stream, a bonus at the draft's (DRAFT_DRAWS): the uniform the draft drew its guess past the window with,
never tested (a position is tested once, in the window that reaches it), so the bonus has law p whatever came
before, and equals the draft's guess wherever p and q agree: Mirror then reuses its main line, as under greedy.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mirror_rt.runtime.sampling import (
    ACCEPTANCE,
    DRAFT_DRAWS,
    SamplingConfig,
    as_tensor,
    choose_at,
    inverse_cdf,
    position_uniform,
    probabilities,
)
from mirror_rt.runtime.token_rules import TokenRules, settle, verify_rows
from mirror_rt.runtime.transfer import host_ids, import_torch, is_tensor


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
           rules: TokenRules | None = None, q: Sequence | None = None) -> Verdict:
    """The verdict on `window` [k] from the target's raw logits [k+1, vocab] over [last] + window, whose first
    token is at position `length` (the committed length). `q`: the draft's distribution of each window token
    (rows [vocab], None for a one-hot), which selects rejection sampling; None: argmax matching when greedy, the
    exact-seed coupling when sampling. Under `rules` (the sequence's, at the committed text) row j is processed at
    the committed text plus window[:j]; the rules then end at the committed text plus the verdict's tokens, whose
    log-probabilities they record. Example (greedy): window [5, 7, 9], argmaxes [5, 7, 3, 4] -> accepted 2,
    correction 3."""
    rows, window, advanced = verify_rows(rules, logits, window)
    if q is None or sampling.greedy:
        choices = choose_at(rows, sampling, seed, length)  # [k'+1] the target's own
        accepted = matched(window, choices)
        verdict = Verdict(length, accepted, int(choices[accepted]))
    else:
        verdict = Verdict(length, *speculative_sample(rows, window, q, sampling, seed, length))
    settle(rules, advanced, window, verdict, logits)
    return verdict


def speculative_sample(rows, window: list[int], q: Sequence, sampling: SamplingConfig, seed: int,
                       length: int) -> tuple[int, int]:
    """Standard speculative sampling over target rows [k+1, vocab] (processed logits): (accepted, correction or
    bonus). Reads back the accepted count and one id, never a vocabulary row."""
    torch = import_torch()
    target = as_tensor(rows)
    p = probabilities(target, sampling)  # [k+1, vocab]
    k = len(window)
    accepted = k
    if k:
        draft = draft_rows(q[:k], window, p)  # [k, vocab]
        at = torch.arange(k, device=p.device)
        ids = torch.tensor(window, dtype=torch.long, device=p.device)
        u = torch.tensor([position_uniform(seed, length + j, ACCEPTANCE) for j in range(k)], dtype=p.dtype,
                         device=p.device)
        rejected = u * draft[at, ids] >= p[at, ids]  # u >= p/q, without dividing by q = 0
        # the first rejection (k when none): argmax finds the first True of [rejected, True]
        first = torch.cat([rejected, torch.ones(1, dtype=torch.bool, device=p.device)]).to(torch.int8).argmax()
        accepted = host_ids(first[None], count=is_tensor(rows))[0]
    if accepted == k:  # the bonus, at the draft guess's uniform (coupled with it)
        row, uniform = p[k], position_uniform(seed, length + k, DRAFT_DRAWS)
    else:  # the correction, from the residual
        row = (p[accepted] - draft[accepted]).clamp_(min=0)
        row = torch.where(row.sum() > 0, row, p[accepted])  # p = q to the last bit: nothing left, p itself
        uniform = position_uniform(seed, length + accepted)
    token = inverse_cdf(row[None], [uniform], count=is_tensor(rows))[0]
    return accepted, token


def draft_rows(q: Sequence, window: list[int], p):
    """The draft's q rows [k, vocab] on p's device, a one-hot row for a token drafted without one (None)."""
    torch = import_torch()
    if len(q) < len(window):
        raise ValueError(f"{len(q)} draft distributions for a window of {len(window)} tokens")
    vocab = p.shape[-1]
    out = torch.zeros((len(window), vocab), dtype=p.dtype, device=p.device)
    for j, (row, token) in enumerate(zip(q, window)):
        if row is None:
            out[j, token] = 1.0
        else:
            row = as_tensor(row)[:vocab]  # a draft's vocabulary may be padded otherwise: zero past its rows
            out[j, :row.shape[-1]] = row.to(device=p.device, dtype=p.dtype)
    return out
