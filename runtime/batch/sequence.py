"""One request inside the batched decoder: its tokens, its row, where it is in its life. Token-level only.

States: waiting (queued) -> prefill (its prompt going into its row, chunk by chunk) -> running -> done.
Invariant: between steps the target cache of a running sequence holds prompt + tokens except the last token.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.grammar import GrammarError
from mirror_rt.runtime.metrics import Metrics


@dataclass(eq=False)
class Sequence:
    """A request's decoding state."""

    id: str
    prompt: list[int]  # token ids
    config: GenerationConfig  # mode resolved (never None)
    budget: int  # tokens it may generate (max_new_tokens within the context)
    sink: Callable | None = None  # (sequence, tokens, drafted, accepted) after each commit
    tokens: list[int] = field(default_factory=list)  # committed output tokens
    state: str = "waiting"  # waiting | prefill | running | done
    row: int | None = None  # its row in the KV pools while it holds one
    computed: int = 0  # prompt positions already in the target cache
    reused: int = 0  # prompt positions taken from the prefix cache
    finish_reason: str | None = None  # length | stop (text) | cancelled | error: <message> | context
    metrics: Metrics = field(default_factory=Metrics)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when it got its row
    target_cache: object = None  # its target cache (a row of the target's pool, or its own) while it holds a row
    draft_cache: object = None  # its draft cache (a pool row or its own); None: none yet (runtime.batch.steps)
    draft_row: object = None  # sd: its draft state, drafting in the decoder's thread (runtime.mirror.draft_row)
    mirror: object = None  # mirror: its side of the draft worker while joined to it (runtime.mirror.step)
    mirror_parts: list = field(default_factory=list)  # (DraftStats, target counters) of each time it was joined
    rules: object = None  # runtime.token_rules.TokenRules at the committed text between steps; None: no rules
    error: Exception | None = None  # what ended it alone (finish_reason error: its grammar failed)

    @property
    def length(self) -> int:
        """Committed positions: prompt + output."""
        return len(self.prompt) + len(self.tokens)

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @contextlib.contextmanager
    def alone(self):
        """A failure of this sequence's own (its grammar: GrammarError) ends it alone, at this step; the batch goes
        on."""
        try:
            yield
        except GrammarError as exc:
            self.error = exc
            self.finish("error")

    def cancel(self) -> None:
        """Stop at the next step boundary (safe from any thread)."""
        self.cancel_event.set()

    def finish(self, reason: str) -> None:
        """Mark the sequence done (the decoder releases its row at the step's end); the first reason wins."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def commit(self, tokens: list[int], drafted: int, accepted: int) -> list[int]:
        """Append a step's tokens within the budget; tell the sink; returns what was appended."""
        tokens = tokens[:max(0, self.remaining)]
        if not tokens:
            return tokens
        self.tokens.extend(tokens)
        if self.sink is not None:
            self.sink(self, tokens, drafted, accepted)
        if self.remaining <= 0:
            self.finish("length")
        return tokens
