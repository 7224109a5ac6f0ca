"""Per-request metrics: counts per step and time per stage, kept outside the algorithm.

Decoders call `record_step` once per target forward after prefill, just before yielding that
step's tokens (the engine takes the step's window from it), and wrap stages in `stage(name)`;
`summary()` turns the counts into the figures the CLI and bench print.
Definitions: mean accepted length = tokens committed per decode step (one target forward
each; 1.0 for target-only decoding); acceptance at position j = accepted / proposed among
windows that had a j-th draft token.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from mirror_rt.runtime.transfer import counters


@dataclass
class Metrics:
    """Counters for one request."""

    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens delivered to the caller
    steps: int = 0  # decode steps (target forwards after prefill)
    committed: int = 0  # tokens committed by decode steps (prefill's first token excluded)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step
    proposed_at: list[int] = field(default_factory=list)  # [gamma] windows with a j-th token
    accepted_at: list[int] = field(default_factory=list)  # [gamma] of those, accepted
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # every duration of each stage, plus "draft_forward" (seconds per draft forward) and, for
    # speculative modes, "target_verify" (seconds per verified window): histograms of the server
    durations: dict[str, list[float]] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # faults and fallbacks, in order
    extra: dict = field(default_factory=dict)  # mode-specific figures (Mirror: reuse, overlap, phases)
    window: tuple[int, int] | None = None  # (proposed, accepted) of the latest step, until the engine takes it
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
            elapsed = time.perf_counter() - t0
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + elapsed
            self.durations.setdefault(name, []).append(elapsed)

    def record_step(self, num_proposed: int, num_accepted: int) -> None:
        """One verified window: `num_accepted` of `num_proposed` draft tokens, plus one more."""
        self.steps += 1
        self.window = (num_proposed, num_accepted)
        self.committed += num_accepted + 1
        self.accept_lengths.append(num_accepted + 1)
        while len(self.proposed_at) < num_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for j in range(num_proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def take_window(self) -> tuple[int, int]:
        """(proposed, accepted) of the step recorded since the last call; (0, 0) when none (the prompt's first
        token, which no verification produced)."""
        window, self.window = self.window or (0, 0), None
        return window

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
            "mean_accepted_length": round(self.committed / self.steps, 3) if self.steps else 0.0,
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
