"""`--draft auto`: put the draft where measured costs predict the most tokens per second, or nowhere.

From the target's measured forward times and, per candidate draft device, the draft's measured forward
time and an acceptance estimate, the latency model (runtime.latency) predicts tokens/s of target-only
decoding, of SD on each candidate and of Mirror on each candidate that runs at once with the target; the
best pairing wins, "no speculation" included (and kept on a tie). Pure arithmetic: timing a few forwards
on each device at load is the caller's, so this module never touches a device. Times are milliseconds;
a Mirror candidate's times must be measured as it would run (its own cores or device, beside the target).
"""

from __future__ import annotations

from dataclasses import dataclass

from mirror_rt.runtime.latency import hit_probability, mirror_step, sd_step, tokens_per_step


@dataclass(frozen=True)
class TargetCosts:
    """The target's measured forwards on its device (ms)."""

    device: str
    token_ms: float  # a one-token forward: target-only decoding's step
    window_ms: float  # a verify window of gamma + 1 tokens
    prefix_ms: float | None = None  # Mirror: the window up to the early exit (None: the target is not split)
    suffix_ms: float | None = None  # Mirror: the window from the early exit on


@dataclass(frozen=True)
class DraftCandidate:
    """A device the draft could run on, as measured there."""

    device: str
    forward_ms: float  # one draft forward (one token; side branches ride in it)
    acceptance: float  # per-token acceptance estimate, in [0, 1]
    concurrent: bool = True  # runs while the target computes (other cores or another device): Mirror possible


@dataclass(frozen=True)
class Pairing:
    """One way to decode and its predicted speed."""

    mode: str  # ar | sd | mirror
    draft: str | None  # the draft's device; None for ar
    tokens_per_s: float

    def describe(self) -> str:
        where = "no speculation" if self.draft is None else f"{self.mode}, draft on {self.draft}"
        return f"{where} {self.tokens_per_s:.1f} tokens/s"


def pairings(target: TargetCosts, candidates: list[DraftCandidate], gamma: int,
             root_coverage: float = 0.0, rendezvous_ms: float = 0.0) -> list[Pairing]:
    """Every pairing's predicted tokens/s, fastest first; `ar` (no speculation) always among them."""
    options = [Pairing("ar", None, 1e3 / target.token_ms)]
    for draft in candidates:
        tokens = tokens_per_step(draft.acceptance, gamma)
        sd = sd_step(gamma * draft.forward_ms, target.window_ms)
        options.append(Pairing("sd", draft.device, 1e3 * tokens / sd))
        if draft.concurrent and target.prefix_ms is not None and target.suffix_ms is not None:
            p_hit = hit_probability(draft.acceptance, gamma, root_coverage)
            rollout, fresh = (gamma + 1) * draft.forward_ms, gamma * draft.forward_ms
            step = mirror_step(target.prefix_ms, target.suffix_ms, rollout, fresh, p_hit, rendezvous_ms)
            options.append(Pairing("mirror", draft.device, 1e3 * tokens / step))
    return sorted(options, key=lambda p: (-p.tokens_per_s, p.draft is not None))  # a tie keeps no speculation


def choose(target: TargetCosts, candidates: list[DraftCandidate], gamma: int, root_coverage: float = 0.0,
           rendezvous_ms: float = 0.0) -> tuple[Pairing, list[Pairing]]:
    """(the best pairing, all pairings fastest first)."""
    ranked = pairings(target, candidates, gamma, root_coverage, rendezvous_ms)
    return ranked[0], ranked


def report(best: Pairing, ranked: list[Pairing], target: TargetCosts) -> str:
    """The one line `--draft auto` prints: what it chose, and the alternatives it beat."""
    others = "; ".join(p.describe() for p in ranked if p is not best)
    return (f"draft auto: {best.describe()} predicted with the target on {target.device} (latency model on "
            f"measured forwards); beside it: {others}")


def table(ranked: list[Pairing]) -> list[str]:
    """Rows for `mirror-rt devices`: mode, draft device, predicted tokens/s, fastest first."""
    return [f"{p.mode:6s} {p.draft or '-':16s} {p.tokens_per_s:8.1f} tokens/s (predicted)" for p in ranked]
