"""How far the batched decoder speculates at each step, from the step costs this engine measures.

Per batch size and way (target-only, gamma = 0, or speculative) it keeps tokens committed per second of decode
step, counting only settled steps, and takes the faster way; it switches only for a gain above `margin`. A step
in which prompts prefill decodes target-only, unless it is spread over every core (no draft worker to leave).
One stream has a third way where its step can spread: speculative steps spread over every core (the draft then
the target, each on all of them) beside Mirror's divided cores (the draft worker on its core, the target on the
others); measured like the other two, so a machine whose cores pay more together than side by side (2 cores at
7B: runtime.batch.verify) spreads.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AR, SPEC, SPREAD = "target-only", "speculative", "speculative, spread"  # SPREAD: one stream's step on every core
SWITCH_MIN = 16  # tokens a sequence must have left for the batch to turn from target-only to speculation


@dataclass
class Rate:
    """Tokens per second of one way of stepping at one batch size: decaying sums of tokens and of seconds."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0  # settled steps measured
    tries: int = 0  # steps taken this way, settled or not

    def add(self, tokens: int, seconds: float, decay: float = 0.9) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.samples += 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SpeculationPolicy:
    """Per-step choice between speculative and target-only decoding (see the module docstring)."""

    explore: int = 6  # settled steps that measure a way at a batch size (and each later trial)
    refresh: int = 400  # steps at a batch size between two trials of the way not taken
    margin: float = 0.1  # relative gain needed to switch ways
    adaptive: bool = True  # False: always speculative while any request speculates (their gamma as asked)
    rates: dict = field(default_factory=dict)  # (way, batch size) -> Rate
    current: dict = field(default_factory=dict)  # batch size -> way in use
    since: dict = field(default_factory=dict)  # batch size -> steps since the way not taken was tried
    trials: dict = field(default_factory=dict)  # batch size -> (way on trial, settled steps it still needs)
    turns: dict = field(default_factory=dict)  # batch size -> trials so far (the ways not taken go in turn)
    last: str = SPEC  # the way of the latest step (the server's gauge)
    # why the latest target-only step was one: asked (no sequence speculates), prompts, tail, measuring, slower
    reason: str | None = None
    previous: str | None = None  # the way of the latest recorded step (a switch is no settled step)

    def gamma(self, decoder, running: list, prompts: bool = False) -> int:
        """Draft tokens per window for this step: the largest any speculating sequence asks for, or 0. `prompts`:
        prompts prefill in this step; adaptive, the step then decodes target-only (see `prompts_first`)."""
        speculating = [s.config.gamma for s in running if s.config.mode != "ar"]
        # a step spread over every core (runtime.batch.verify `spreads`) has no draft worker to leave or join: its
        # prompts took every core before it, and its draft catches up in this thread
        free = decoder is not None and decoder.mirror.batch.spreads(running)
        self.reason = "asked" if not speculating else "prompts" if self.prompts_first(prompts) and not free else (
            "tail" if self.too_late(running) and not free else None)
        if not speculating:
            return 0
        ways = (SPEC, SPREAD, AR) if decoder is not None and decoder.mirror.batch.spreads_one(running) else (SPEC, AR)
        self.last = AR if self.reason else self.choose(len(running), ways)
        return max(speculating) if self.last != AR else 0

    def too_late(self, running: list) -> bool:
        """Whether speculation would start too late to pay: adaptive, after target-only steps, < SWITCH_MIN tokens left
        to every sequence."""
        return self.adaptive and self.previous == AR and max(s.remaining for s in running) < SWITCH_MIN

    def prompts_first(self, prompts: bool) -> bool:
        """Whether a step with prompts to prefill decodes target-only: adaptive, yes."""
        return prompts and self.adaptive

    def choose(self, batch: int, ways: tuple = (SPEC, AR)) -> str:
        """The way of the next step at `batch` among `ways` (speculative ones first, AR last)."""
        if not self.adaptive:
            return ways[0]
        for way in ways if batch <= 1 else (AR, *ways[:-1]):  # measure what this batch size has not seen
            rate = self._rate(way, batch)
            exploring = rate.samples < self.explore and rate.tries < 3 * self.explore
            if exploring and (way == AR or self._may_win(batch)):
                self.reason = "measuring"
                return way
        trial = self.trials.get(batch)
        if trial and trial[0] in ways:
            self.reason = "measuring"
            return trial[0]
        current = self.current.get(batch)
        current = current if current in ways else self._fastest(batch, ways)
        others = [way for way in ways if way != current]
        self.since[batch] = self.since.get(batch, 0) + 1
        tried = [way for way in others if way == AR or self._may_win(batch)]
        if self.since[batch] >= self.refresh and tried:
            self.since[batch] = 0
            other = tried[self.turns.get(batch, 0) % len(tried)]  # each way not taken in turn
            self.turns[batch] = self.turns.get(batch, 0) + 1
            self.trials[batch] = (other, self.explore)
            return other
        best = max(others, key=lambda way: self._rate(way, batch).tokens_per_s)
        if self._rate(best, batch).tokens_per_s > (1 + self.margin) * self._rate(current, batch).tokens_per_s:
            current = best
        self.current[batch] = current
        self.reason = "slower"
        return current

    def record(self, way: str, batch: int, tokens: int, seconds: float, settled: bool = True) -> None:
        """A step's outcome: `tokens` committed in `seconds` of decode by `batch` running sequences; `settled`
        False when a sequence decoded its first window. A step that switched ways is never settled."""
        switched, self.previous = self.previous not in (None, way), way
        self._rate(way, batch).tries += 1
        if not settled or switched:
            return
        self._rate(way, batch).add(tokens, seconds)
        trial = self.trials.get(batch)
        if trial and trial[0] == way:
            self.trials[batch] = (way, trial[1] - 1) if trial[1] > 1 else None

    def _fastest(self, batch: int, ways: tuple) -> str:
        """The measured way with the most tokens/s (a speculative one on a tie; AR if none was measured)."""
        measured = [way for way in ways if self._rate(way, batch).samples]
        return max(measured, key=lambda way: (self._rate(way, batch).tokens_per_s, way != AR)) if measured else AR

    def _may_win(self, batch: int) -> bool:
        """Whether speculation is worth trying at `batch`: unless it lost to target-only at the largest smaller batch
        that measured both ways (a speculative step verifies every row in one target call, runtime.batch.verify: it
        is measured at the batch it runs, not guessed from one stream; a batch with nothing below measured tries)."""
        for below in range(batch - 1, 0, -1):
            specs = [rate for way in (SPEC, SPREAD) if (rate := self.rates.get((way, below))) and rate.samples]
            ar = self.rates.get((AR, below))
            if specs and ar and ar.samples:
                return max(rate.tokens_per_s for rate in specs) > ar.tokens_per_s
        return True

    def _rate(self, way: str, batch: int) -> Rate:
        return self.rates.setdefault((way, batch), Rate())
