"""What one finished request measured: for its response, the metrics and the access log.

Built once from a scheduler job at its end; n choices are one record (speculation figures: the first choice's).
Times are perf_counter seconds from arrival. `timings` follows llama-server's; `speculation` is the `mirror_rt`
object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirror_rt.runtime.metrics import why_target_only

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length"}


@dataclass
class RequestRecord:
    """One request's figures (a request that never ran has `ran` False)."""

    id: str
    outcome: str  # done | cancelled | timeout | error
    finish_reason: str  # stop | length | abort | error
    e2e_s: float
    queue_s: float | None
    ran: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    steps: list = field(default_factory=list)  # per choice, runtime.generation.Step per decode step
    stats: dict = field(default_factory=dict)  # Generation.stats
    durations: dict = field(default_factory=dict)  # Generation.durations
    names: dict = field(default_factory=dict)  # Engine.names (devices, path, precision)
    finish_reasons: list = field(default_factory=list)  # per choice: stop | length | abort | error
    constraint: str | None = None  # the kind of grammar the request ran under (metrics label), or None

    @classmethod
    def from_job(cls, job, names: dict) -> RequestRecord:
        gens = [g for g in job.generations if g.stats]
        queue_s = None if job.started is None else job.started - job.arrived
        e2e = (job.finished or job.arrived) - job.arrived
        reason = {"cancelled": "abort", "timeout": "error", "error": "error"}.get(job.outcome)
        constraint = getattr(job, "constraint", None)
        if not gens:
            return cls(job.id, job.outcome, reason or "error", e2e, queue_s, False, names=names,
                       constraint=constraint)
        finish = [reason or FINISH.get(g.stop_reason, "stop") for g in gens]
        stats = merged_stats([g.stats for g in gens])
        first = gens[0].steps[0].time - job.arrived if gens[0].steps else None
        durations = {k: [v for g in gens for v in g.durations.get(k, ())] for k in gens[0].durations}
        return cls(job.id, job.outcome, finish[0], e2e, queue_s, True, stats["prompt_tokens"], stats["new_tokens"],
                   first, [list(g.steps) for g in gens], stats, durations, names, finish, constraint)

    @property
    def draft_fault(self) -> bool:
        return any(str(e).startswith("fallback to target-only") for e in self.stats.get("events", ()))

    def timings(self) -> dict:
        """llama-server's per-response figures, with the draft counts."""
        s = self.stats
        prompt_ms = 1e3 * s.get("time_to_first_token_s", 0.0)
        predicted_ms = max(0.0, 1e3 * s.get("wall_time_s", 0.0) - prompt_ms)
        n = self.completion_tokens
        return {"prompt_n": self.prompt_tokens, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(1e3 * self.prompt_tokens / prompt_ms, 2) if prompt_ms else None,
                "predicted_n": n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(predicted_ms / (n - 1), 3) if n > 1 else None,
                "predicted_per_second": round(1e3 * (n - 1) / predicted_ms, 2) if n > 1 and predicted_ms else None,
                "draft_n": sum(s.get("proposed_per_position", [])),
                "draft_n_accepted": sum(s.get("accepted_per_position", []))}

    def speculation(self) -> dict:
        """What only speculation knows: acceptance per position, reuse, hidden draft time, devices."""
        s, mode = self.stats, self.stats.get("mode")
        mirror = mode == "mirror"
        return {"mode": mode, "mean_accepted_length": s.get("mean_accepted_length"),
                "steps": s.get("steps"), "speculative_steps": s.get("speculative_steps"),  # the load policy's choice
                "speculated": bool(s.get("speculative_steps")), "target_only_steps": s.get("target_only_steps", {}),
                "spread_steps": s.get("spread_steps", 0),  # of the speculative steps, those run on every core
                "why_target_only": why_target_only(s),
                "mean_gamma": s.get("mean_gamma"),
                "acceptance_per_position": s.get("acceptance_per_position", []),
                "reuse_hit_rate": s.get("reuse_hit_rate") if mirror else None,
                "hidden_draft_share": s.get("hidden_draft_share") if mirror else None,
                "draft_forwards_per_token": s.get("draft_forwards_per_token") if mirror else None,
                "devices": {"target": self.names.get("target_device"),
                            "draft": self.names.get("draft_device") if mode != "ar" else None},
                "path": self.names.get("path"),
                "precision": {"target": self.names.get("target_precision"),
                              "draft": self.names.get("draft_precision") if mode != "ar" else None},
                "queue_ms": round(1e3 * self.queue_s, 3) if self.queue_s is not None else None,
                "events": list(s.get("events", []))}

    def summary(self, ended_at: float) -> dict:
        """One row of the server page's recent requests (`ended_at`: unix time of its end)."""
        timings = self.timings() if self.ran else {}
        drafted = timings.get("draft_n", 0)
        return {"id": self.id, "ended_at": round(ended_at, 3), "mode": self.stats.get("mode"),
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_ms": round(1e3 * self.ttft_s, 1) if self.ttft_s is not None else None,
                "e2e_ms": round(1e3 * self.e2e_s, 1), "tokens_per_s": timings.get("predicted_per_second"),
                "mean_accepted_length": self.stats.get("mean_accepted_length"),
                "acceptance": round(timings["draft_n_accepted"] / drafted, 3) if drafted else None,
                "steps": self.stats.get("steps"), "speculative_steps": self.stats.get("speculative_steps"),
                "why_target_only": why_target_only(self.stats) if self.ran else None}

    def log_line(self) -> str:
        """The access-log line: id, tokens, TTFT, tokens/s, finish reason."""
        ttft = f"{1e3 * self.ttft_s:.0f} ms" if self.ttft_s is not None else "-"
        rate = self.completion_tokens / self.e2e_s if self.e2e_s > 0 else 0.0
        note = "" if self.outcome in ("done", "cancelled") else f" ({self.outcome})"
        return (f"{self.id} prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
                f"ttft={ttft} tokens_per_s={rate:.1f} finish_reason={self.finish_reason}{note}")


def merged_stats(stats: list[dict]) -> dict:
    """One request's figures from its choices' stats: tokens, time and draft counts summed, the rest the first's."""
    if len(stats) == 1:
        return stats[0]
    out = dict(stats[0])
    out["wall_time_s"] = max(s.get("wall_time_s", 0.0) for s in stats)  # the choices decode together
    for key in ("new_tokens", "draft_hidden_s", "reuse_hits", "reuse_checks", "steps", "speculative_steps"):
        if key in out:
            out[key] = sum(s.get(key, 0) for s in stats)
    out["target_only_steps"] = {}
    for s in stats:
        for reason, count in s.get("target_only_steps", {}).items():
            out["target_only_steps"][reason] = out["target_only_steps"].get(reason, 0) + count
    for key in ("proposed_per_position", "accepted_per_position"):
        width = max(len(s.get(key, [])) for s in stats)
        out[key] = [sum(s.get(key, [])[i] if i < len(s.get(key, [])) else 0 for s in stats) for i in range(width)]
    return out
