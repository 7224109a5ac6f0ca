"""Per-request metrics: counts per step and time per stage, kept outside the algorithm.

Decoders call `record_step` once per target forward after prefill and wrap stages in `stage(name)`; `summary()`
gives the figures the CLI and bench print, `format_stats` the lines `run --stats` prints. Mean accepted length =
1 + accepted draft tokens per decode step (vLLM's mean acceptance length). Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from mirror_rt.runtime.transfer import counters

# why steps of a speculative request ran target-only: the policy's reasons (runtime.batch.policy) and the decoder's
# (last_token, draft_failed, empty_window), as responses and `run --stats` say them
WHY_TARGET_ONLY = {
    "asked": "the request asked for target-only decoding (mode ar)",
    "prompts": "a prompt was being read in the same step, its own or another's (the batch decodes target-only then)",
    "tail": "too few tokens were left for speculation to pay back its start",
    "measuring": "the load policy was measuring target-only decoding at this batch size",
    "slower": "the load policy measured speculation slower than target-only decoding at this batch size",
    "last_token": "the last token left no room for a draft window",
    "draft_failed": "the draft failed, so decoding went on target-only",
    "empty_window": "the draft's window held no token",
}
# the same reasons in the words of one prompt (`mirror-rt run --stats`): no other request, no batch to speak of
ONE_PROMPT = WHY_TARGET_ONLY | {
    "prompts": "the prompt was being read, and a step that reads one decodes target-only",
    "measuring": "the first steps timed target-only decoding, for adaptive speculation to compare with speculation",
    "slower": "adaptive speculation measured speculation slower than target-only decoding on this machine",
}


@dataclass
class Metrics:
    """Counters for one request."""

    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens the model generated: an ending EOS included (as usage.completion_tokens)
    steps: int = 0  # decode steps (target forwards after prefill)
    committed: int = 0  # tokens committed by decode steps (prefill's first token excluded)
    speculative_steps: int = 0  # steps that verified draft tokens (the rest: target-only, as the load policy chose)
    spread_steps: int = 0  # of those, steps whose draft then target ran on every core (no draft worker beside)
    target_only: dict[str, int] = field(default_factory=dict)  # the other steps by why (WHY_TARGET_ONLY's keys)
    drafted: int = 0  # draft tokens those steps verified
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step
    proposed_at: list[int] = field(default_factory=list)  # [gamma] windows with a j-th token
    accepted_at: list[int] = field(default_factory=list)  # [gamma] of those, accepted
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # every duration of each stage, plus "draft_forward" (seconds per draft forward) and, for
    # speculative modes, "target_verify" (seconds per verified window): histograms of the server
    durations: dict[str, list[float]] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # faults and fallbacks, in order
    extra: dict = field(default_factory=dict)  # mode-specific figures (Mirror: reuse, overlap, phases)
    window: tuple[int, int] | None = None  # (proposed, accepted) of the latest step (None: none yet)
    start: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    end: float | None = None
    # device->host reads of the decoding thread (runtime.transfer) when the request started, and at its end
    reads_at_start: tuple[int, int] = field(default_factory=counters)
    reads_at_end: tuple[int, int] | None = None

    @contextmanager
    def stage(self, name: str):
        """Add the wall time of the enclosed block to stage `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_stage(name, time.perf_counter() - t0)

    def add_stage(self, name: str, seconds: float) -> None:
        """Add `seconds` of wall time to stage `name` (a block timed elsewhere)."""
        self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + seconds
        self.durations.setdefault(name, []).append(seconds)

    def record_step(self, num_proposed: int, num_accepted: int) -> None:
        """One verified window: `num_accepted` of `num_proposed` draft tokens, plus one more."""
        self.steps += 1
        self.speculative_steps += num_proposed > 0
        self.drafted += num_proposed
        self.window = (num_proposed, num_accepted)
        self.committed += num_accepted + 1
        self.accept_lengths.append(num_accepted + 1)
        while len(self.proposed_at) < num_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for j in range(num_proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def trim_last_step(self, kept: int) -> None:
        """The text ended after the latest step's first `kept` tokens (an end-of-sequence or a stop string inside
        the window): positions past them were never delivered, so they count neither as proposed nor accepted."""
        proposed, accepted = self.window or (0, 0)
        if kept >= accepted + 1:
            return
        for j in range(kept, proposed):
            self.proposed_at[j] -= 1
            self.accepted_at[j] -= j < accepted
        self.drafted -= max(0, proposed - kept)
        self.committed -= accepted + 1 - kept
        self.accept_lengths[-1] = kept
        self.window = (min(proposed, kept), min(accepted, kept))

    def finish(self) -> None:
        """Mark the end of the request (wall time, device reads); call from the decoding thread."""
        self.end = time.perf_counter()
        self.reads_at_end = counters()

    def summary(self) -> dict:
        """Derived figures (JSON-serialisable)."""
        end = self.end or time.perf_counter()
        read_bytes, reads = (b - a for a, b in zip(self.reads_at_start, self.reads_at_end or counters()))
        wall = end - self.start
        decode = end - (self.first_token_at or self.start)
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "wall_time_s": round(wall, 4),
            "time_to_first_token_s": round((self.first_token_at or end) - self.start, 4),
            "tokens_per_s": round(self.new_tokens / wall, 2) if wall > 0 else 0.0,
            "decode_tokens_per_s": (round((self.new_tokens - 1) / decode, 2)
                                    if decode > 0 and self.new_tokens > 1 else 0.0),
            "steps": self.steps,
            "mean_accepted_length": round(1 + sum(self.accepted_at) / self.steps, 3) if self.steps else 0.0,
            "speculative_steps": self.speculative_steps,  # of `steps`; the others ran target-only
            "spread_steps": self.spread_steps,  # of them, the draft then the target on every core
            "target_only_steps": dict(self.target_only),  # why the others did, by reason
            "mean_gamma": round(self.drafted / self.speculative_steps, 3) if self.speculative_steps else 0.0,
            "acceptance_per_position": [round(a / p, 3) if p else 0.0
                                        for a, p in zip(self.accepted_at, self.proposed_at)],
            "proposed_per_position": list(self.proposed_at),  # windows with a j-th draft token
            "accepted_per_position": list(self.accepted_at),  # of them, accepted
            "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()},
            "events": list(self.events),
            "accept_lengths": list(self.accept_lengths),
            # target side, read back from the model's device (runtime.transfer); host backends read nothing
            "device_to_host_bytes_per_token": round(read_bytes / self.new_tokens, 1) if self.new_tokens else 0.0,
            "device_reads_per_step": round(reads / (self.steps + 1), 2),  # each read of a GPU tensor is a sync
            **self.extra,
        }


def why_target_only(stats: dict, words: dict[str, str] = WHY_TARGET_ONLY) -> str | None:
    """One sentence on the steps that did not speculate and why (None when every step did); `words`: the reasons'
    wording (ONE_PROMPT for a single prompt)."""
    reasons = stats.get("target_only_steps") or {}
    steps, speculative = stats.get("steps") or 0, stats.get("speculative_steps") or 0
    if not reasons or not steps:
        return None
    said = "; ".join(f"{words.get(r, r)} ({n} step{'s' * (n != 1)})"
                     for r, n in sorted(reasons.items(), key=lambda item: -item[1]))
    if not speculative:
        return f"no speculation: {said}"
    return f"speculated in {speculative} of {steps} steps; target-only: {said}"


def format_stats(stats: dict) -> str:
    """A generation's stats (`Generation.stats`: this summary, the engine's names, Mirror's extras) as the
    lines `mirror-rt run --stats` prints."""
    acc = " ".join(f"{a:.2f}" for a in stats.get("acceptance_per_position", []))
    lines = [
        (f"mode {stats['mode']}: {stats['new_tokens']} tokens in {stats['wall_time_s']:.2f} s = "
         f"{stats['tokens_per_s']:.1f} tokens/s (decode {stats['decode_tokens_per_s']:.1f} tokens/s, "
         f"first token {stats['time_to_first_token_s'] * 1000:.0f} ms)"),
        f"steps {stats['steps']}, mean accepted length {stats['mean_accepted_length']:.2f} tokens per target forward",
    ]
    if acc:
        lines.append(f"acceptance per position: {acc}")
    if stats.get("draft"):
        lines.append(f"draft: {stats['draft']}")
    if stats.get("target_precision"):
        lines.append(f"path: {stats.get('path', '?')}, target {stats['target_precision']}"
                     + (f", draft {stats['draft_precision']}" if stats.get("draft_precision") else ""))
    if stats.get("placement"):
        lines.append(f"placement: {stats['placement']}")
    if stats.get("device_reads_per_step"):
        lines.append(f"device->host {stats['device_to_host_bytes_per_token']:.0f} bytes per token, "
                     f"{stats['device_reads_per_step']:.2f} reads (syncs) per step")
    if "reuse_hit_rate" in stats:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in stats["phase_ms_per_step"].items())
        lines.append(f"reuse hit rate {stats['reuse_hit_rate']:.2f} (main {stats['main_line_hits']}, side "
                     f"{stats['side_branch_hits']}, wrong {stats['misses']}, not ready {stats['not_ready']}); "
                     f"early-exit coverage {_coverage(stats['early_exit_coverage'])}; hidden draft share "
                     f"{stats['hidden_draft_share']:.2f}")
        lines.append(f"draft forwards per token {stats['draft_forwards_per_token']:.2f}; prompt-lookup guesses "
                     f"kept {stats['lookup_guesses_kept']}")
        lines.append(f"ms per step: {phases}; latency model {stats['predicted_step_ms']:.1f} ms predicted "
                     f"(pipelined form {stats['predicted_step_ms_pipelined']:.1f}), "
                     f"{stats['measured_step_ms']:.1f} ms measured")
    if stats.get("mode") != "ar" and (why := why_target_only(stats, ONE_PROMPT)):
        lines.append(why)
    if stats.get("spread_steps"):
        lines.append(f"{stats['spread_steps']} of {stats['speculative_steps']} speculative steps spread over every "
                     "core (the draft, then the target's verify, each on all of them): adaptive speculation measures "
                     "them beside the draft and the target side by side, and keeps the faster")
    for event in stats.get("events", []):
        lines.append(f"event: {event}")
    if stats.get("load_time_s") is not None:
        lines.append(f"load: {stats['load_time_s']:.2f} s (engine ready, before the prompt)")
    lines.append(f"stop: {stats['stop_reason']}")
    return "\n".join(lines)


def _coverage(value) -> str:
    """Early-exit coverage for the stats text: a share, or why there is none (no window was corrected)."""
    return "- (no corrections)" if value is None else f"{value:.2f}"
