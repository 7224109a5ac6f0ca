"""The latency model of speculative decoding (mirror-sd.md §5): tokens per step and time per step.

Pure arithmetic on costs in one unit (ms or s), shared by the simulator (evaluation.simulate), each
Mirror request's stats (runtime.mirror.stats) and draft placement (devices.auto_draft). With per-token
acceptance a and k = gamma:
    tokens per step = 1 + E[accepted] = (1 - a^(k+1)) / (1 - a)         (k + 1 when a = 1)
    SD step         = T_draft(k) + T_target(k + 1)    (k draft forwards, then the target's window)
    Mirror step     = T_prefix + T_rendezvous + max(T_suffix, T_rollout) + P(miss) * T_fresh
    P(hit)          = a^(k+1) + sum_{j<k} a^j (1 - a) * root_coverage    (main line + precomputed corrections)
It knows no device and measures nothing.
"""

from __future__ import annotations


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
