"""A generation as its caller sees it (`Generation`: text pieces, tokens, stats, the cancel hook) and each of its
decode steps (`Step`: tokens committed, the window verified, every token's origin). The engine (runtime.engine)
fills them in."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from mirror_rt.runtime.batch.sequence import Sequence

# Where a committed token came from. A later issue adds "forced" (grammar-forced tokens): readers must take
# an origin they do not know as plain text.
ORIGINS = ("target", "draft", "correction", "bonus")


@dataclass(frozen=True)
class Step:
    """One decode step of one generation: when, how many tokens it committed, the window it verified."""

    time: float  # perf_counter when the tokens were committed
    tokens: int  # tokens committed by the step
    drafted: int = 0  # k: draft tokens the target verified (0: a target-only step, or the prompt's first token)
    accepted: int = 0  # A: of them, accepted
    forced: tuple[int, ...] = ()  # positions whose token the grammar allowed alone (structured output)

    def origin(self, position: int) -> str:
        """Where the step's token at `position` (0-based) came from: `forced` when the grammar allowed it alone,
        else the first A are accepted draft tokens, the last is the target's correction (A < k), its bonus token
        (A == k > 0), or its own (k == 0)."""
        if position in self.forced:
            return "forced"
        if position < self.accepted:
            return "draft"
        if self.drafted == 0:
            return "target"
        return "bonus" if self.accepted == self.drafted else "correction"


@dataclass(eq=False)
class Generation:
    """A generation in progress: iterate for text pieces; text, tokens and stats fill in."""

    pieces: Iterator[str] = iter(())
    text: str = ""  # the full text so far
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS excluded), growing as it runs
    end_token: int | None = None  # the end-of-sequence token that ended the text (committed, counted, not in tokens)
    stop_reason: str | None = None  # eos | stop_string | max_new_tokens | context | cancelled | error
    stats: dict = field(default_factory=dict)  # Metrics.summary() plus mode and models
    steps: list[Step] = field(default_factory=list)  # one per decode step
    logprobs: list = field(default_factory=list)  # TokenLogprob per token of `tokens` so far, then the EOS
    durations: dict[str, list[float]] = field(default_factory=dict)  # Metrics.durations, once finished
    cancel_event: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    on_piece: Callable[[Generation, str], None] | None = None  # push mode: each text piece (engine thread)
    on_finish: Callable[[Generation], None] | None = None  # push mode: once, after the stats are in
    queued: list[str] = field(default_factory=list)  # pull mode: pieces not yet taken
    sequence: Sequence | None = None  # its state in the decoder (runtime.batch.sequence)
    settle: Callable[[Generation], None] | None = field(default=None, repr=False)  # pull mode: step until it left

    def __iter__(self):
        return self.pieces

    def cancel(self) -> None:
        """Stop at the next step boundary (safe from any thread); the stop reason becomes `cancelled`."""
        self.cancel_event.set()

    def close(self) -> None:
        """Stop a stream left early (a `break`): cancelled and out of the batch when this returns; its text so far
        stays. A stream nobody holds any more is cancelled too, and leaves at the engine's next step."""
        if not self.finished:
            self.cancel()
        if isinstance(self.pieces, Generator):  # the engine's (`Engine._drive`): closing it runs its `finally`
            self.pieces.close()
        if self.settle is not None and not self.finished:
            self.settle(self)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()
