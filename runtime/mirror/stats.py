"""Mirror-SD figures: reuse, early-exit coverage, hidden draft time, and the latency model (mirror-sd.md §5).

The latency model is pure arithmetic on costs in one unit, shared with evaluation.simulate and devices.auto_draft.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirror_rt.runtime.mirror.draft_row import DraftStats


@dataclass
class TargetCounters:
    """The target side's figures of a sequence while it was joined to the draft worker (runtime.mirror.step)."""

    corrections: int = 0  # windows the target corrected
    exit_covered: int = 0  # of them, those whose correction was among the early exit's candidates
    fallback_steps: int = 0  # target-only steps after its draft failed
    exit_steps: int = 0  # steps that computed the early exit
    busy: list[tuple[float, float]] = field(default_factory=list)  # the target's verification intervals


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each sorted, non-overlapping within itself)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def mirror_summary(metrics, draft_stats: DraftStats, counters: TargetCounters) -> dict:
    """The Mirror-specific part of a request's stats."""
    steps = max(1, metrics.steps - counters.fallback_steps)
    draft_busy = sum(e - s for s, e in draft_stats.busy)
    hits = draft_stats.main_hits + draft_stats.side_hits
    decided = hits + draft_stats.misses + draft_stats.not_ready
    stage = metrics.stage_seconds
    wait = stage.get("target_wait", 0.0)
    p_miss = (draft_stats.misses + draft_stats.not_ready) / decided if decided else 1.0
    # a batched step's verify (runtime.batch.verify) is one figure, prefix and suffix together: counted as the suffix
    # (the model's serial form is then its pipelined form)
    verify = stage.get("target_verify", 0.0) / steps
    t_prefix, t_suffix = stage.get("target_prefix", 0.0) / steps, stage.get("target_suffix", 0.0) / steps + verify
    t_rollout = draft_stats.rollout_s / steps
    t_fresh = draft_stats.fresh_s / max(1, draft_stats.misses + draft_stats.not_ready)
    t_rendezvous = max(0.0, wait - draft_stats.fresh_s) / steps
    predicted = mirror_step(t_prefix, t_suffix, t_rollout, t_fresh, 1 - p_miss, t_rendezvous)
    pipelined = mirror_step(0.0, t_prefix + t_suffix, t_rollout, t_fresh, 1 - p_miss, t_rendezvous)
    decode = wait / steps + t_prefix + t_suffix
    hidden = overlap_seconds(draft_stats.busy, counters.busy)
    return {
        "reuse_hit_rate": round(hits / decided, 3) if decided else 0.0,
        "reuse_hits": hits,  # verdicts whose next window was precomputed (main line or side branch)
        "reuse_checks": decided,  # verdicts checked against the precomputed windows
        "draft_busy_s": round(draft_busy, 4),
        "draft_hidden_s": round(hidden, 4),  # draft time that ran while the target computed
        "main_line_hits": draft_stats.main_hits,
        "side_branch_hits": draft_stats.side_hits,
        "misses": draft_stats.misses,
        "not_ready": draft_stats.not_ready,
        "side_branches_rolled": draft_stats.branches_rolled,
        "early_exit_coverage": round(counters.exit_covered / counters.corrections, 3)
        if counters.corrections else None,
        "hidden_draft_share": round(hidden / draft_busy, 3) if draft_busy else 0.0,
        "phase_ms_per_step": {"target_prefix": round(1e3 * t_prefix, 2), "target_suffix": round(1e3 * t_suffix, 2),
                              "rendezvous_wait": round(1e3 * wait / steps, 2),
                              "draft_rollout": round(1e3 * t_rollout, 2),
                              "draft_fresh_per_miss": round(1e3 * t_fresh, 2)},
        "predicted_step_ms": round(1e3 * predicted, 2),
        "predicted_step_ms_pipelined": round(1e3 * pipelined, 2),
        "measured_step_ms": round(1e3 * decode, 2),
        "fallback_steps": counters.fallback_steps,
        "early_exit_steps": counters.exit_steps,
        "mean_window": round(sum(metrics.proposed_at) / steps, 3),  # draft tokens verified per step
        "draft_forwards_per_token": round(draft_stats.forwards / max(1, metrics.committed), 3),
        "draft_rollbacks_per_step": round(draft_stats.rollbacks / steps, 3),
        "lookup_guesses_kept": f"{draft_stats.guesses_kept}/{draft_stats.guessed}",
        "forced_draft_tokens": draft_stats.forced,  # grammar-forced tokens drafted without a forward
    }


def batch_stats(seq) -> dict:
    """What batching did for a finished request (runtime.batch.sequence.Sequence): its prompt from the prefix cache,
    its speculative steps, Mirror's figures over the parts it speculated in (and every draft forward's time)."""
    steps = max(1, seq.metrics.steps)
    stats = {"prompt_tokens_cached": seq.reused,
             "speculative_step_share": round(seq.metrics.speculative_steps / steps, 3)}
    drafts = [s for s, _ in seq.mirror_parts] + ([seq.draft_row.stats] if seq.draft_row is not None else [])
    if seq.mirror_parts:
        counters = summed([c for _, c in seq.mirror_parts], TargetCounters)
        stats |= mirror_summary(seq.metrics, summed([s for s, _ in seq.mirror_parts], DraftStats), counters)
    if drafts:
        seq.metrics.durations["draft_forward"] = [end - start for s in drafts for start, end in s.busy]
    return stats


def summed(parts: list, kind):
    """Figures of several parts (DraftStats, TargetCounters) added up: numbers summed, intervals in time order."""
    total = kind()
    for part in parts:
        for name, value in vars(part).items():
            vars(total)[name] = vars(total)[name] + value
    total.busy.sort()
    return total


def tokens_per_step(acceptance: float, gamma: int) -> float:
    """Expected tokens committed per target forward (accepted draft tokens plus the target's own)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def hit_probability(acceptance: float, gamma: int, root_coverage: float) -> float:
    """P(the next window was precomputed): all accepted, or the correction among the side roots."""
    a = acceptance
    return a ** (gamma + 1) + sum(a ** j * (1 - a) * root_coverage for j in range(gamma))


def sd_step(draft_window: float, target_window: float) -> float:
    """One SD step: the draft drafts its window, then the target verifies it; one after the other."""
    return draft_window + target_window


def mirror_step(prefix: float, suffix: float, rollout: float, fresh: float, p_hit: float,
                rendezvous: float = 0.0) -> float:
    """One Mirror step: the target's suffix and the draft's rollout at once, a fresh window after a miss."""
    return prefix + rendezvous + max(suffix, rollout) + (1 - p_hit) * fresh
