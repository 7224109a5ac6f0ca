"""How far the batched decoder speculates at each step, from the step costs this engine measures.

A step of B running sequences is decoded one of two ways: target-only (one batched target call on every
core, one token per sequence) or speculative (each speculating sequence verifies a window of up to gamma draft
tokens: Mirror or sd; Mirror also adapts its window to acceptance, runtime.draft_row). The policy keeps, per
batch size and way, a running mean of tokens committed per second of decode step (what the latency model
predicts from step costs and acceptance, measured directly), and takes the faster way: gamma = 0 is target-only.
A way not yet measured at a batch size is tried for `explore` steps, unless speculation already lost at a smaller
batch (its gain only shrinks as the batch grows: the target verifies windows one sequence a call, while
target-only steps share one call); the way not taken is measured again every `refresh` steps; the decoder
switches only for a gain above `margin` (fixed switch points made vLLM users' throughput fall off cliffs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

AR, SPEC = "target-only", "speculative"


@dataclass
class Rate:
    """A running mean of tokens per second of one way of stepping at one batch size."""

    tokens_per_s: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float, weight: float = 0.2) -> None:
        rate = tokens / seconds if seconds > 0 else 0.0
        self.tokens_per_s = rate if not self.samples else (1 - weight) * self.tokens_per_s + weight * rate
        self.samples += 1


@dataclass
class SpeculationPolicy:
    """Per-step choice between speculative and target-only decoding (see the module docstring)."""

    explore: int = 2  # steps to measure a way not yet measured at a batch size
    refresh: int = 400  # steps at a batch size between two measurements of the way not taken
    margin: float = 0.1  # relative gain needed to switch ways
    adaptive: bool = True  # False: always speculative while any request speculates (their gamma as asked)
    rates: dict = field(default_factory=dict)  # (way, batch size) -> Rate
    current: dict = field(default_factory=dict)  # batch size -> way in use
    since: dict = field(default_factory=dict)  # batch size -> steps since the way not taken was measured
    last: str = SPEC  # the way of the latest step (the server's gauge)

    def gamma(self, decoder, running: list) -> int:
        """Draft tokens per window for this step: the largest any speculating sequence asks for, or 0."""
        speculating = [s.config.gamma for s in running if s.config.mode != "ar"]
        if not speculating:
            return 0
        self.last = self.choose(len(running))
        return max(speculating) if self.last == SPEC else 0

    def choose(self, batch: int) -> str:
        if not self.adaptive:
            return SPEC
        for way in (SPEC, AR):  # measure what this batch size has not seen
            if self._rate(way, batch).samples < self.explore and not (way == SPEC and self._lost_below(batch)):
                return way
        current = self.current.get(batch) or self._faster(batch)
        other = AR if current == SPEC else SPEC
        self.since[batch] = self.since.get(batch, 0) + 1
        if self.since[batch] >= self.refresh and not (other == SPEC and self._lost_below(batch)):
            self.since[batch] = 0
            return other
        if self._rate(other, batch).tokens_per_s > (1 + self.margin) * self._rate(current, batch).tokens_per_s:
            current = other
        self.current[batch] = current
        return current

    def record(self, way: str, batch: int, tokens: int, seconds: float) -> None:
        """A step's outcome: `tokens` committed in `seconds` of decode by `batch` running sequences."""
        self._rate(way, batch).add(tokens, seconds)

    def _faster(self, batch: int) -> str:
        spec, ar = self._rate(SPEC, batch), self._rate(AR, batch)
        return SPEC if spec.samples and spec.tokens_per_s >= ar.tokens_per_s else AR

    def _lost_below(self, batch: int) -> bool:
        """Whether speculation was measured slower than target-only at some smaller batch size."""
        for b in range(1, batch):
            spec, ar = self.rates.get((SPEC, b)), self.rates.get((AR, b))
            if spec and ar and spec.samples >= self.explore and ar.samples >= self.explore \
                    and spec.tokens_per_s < ar.tokens_per_s:
                return True
        return False

    def _rate(self, way: str, batch: int) -> Rate:
        return self.rates.setdefault((way, batch), Rate())
