"""Per-sequence token rules: grammar, logit bias and penalties, as one narrow state every decoder uses.

`apply(logits)` processes ONE position at the current state, `accept(token)` advances (False, and no advance,
when the grammar forbids the token), `rollback(n)` undoes the last n accepts, `forced()` lists the tokens the
grammar forces next, `fork()` copies the state. A verify window goes through `verify_rows` then `settle`: the
rules end at the committed text. Bias and penalties follow vLLM's order and definitions. It knows no model.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mirror_rt.runtime import grammar
from mirror_rt.runtime.grammar import Constraint
from mirror_rt.runtime.logprobs import MAX_TOP, TokenLogprob, token_logprobs
from mirror_rt.runtime.sampling import as_tensor, stack_rows
from mirror_rt.runtime.transfer import import_torch
from mirror_rt.runtime.values import is_integer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RulesConfig:
    """What the token rules of a request do (all off by default)."""

    constraint: Constraint | None = None  # the grammar the output must match
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100), OpenAI's logit_bias
    presence_penalty: float = 0.0  # -2..2, subtracted once from every generated token
    frequency_penalty: float = 0.0  # -2..2, subtracted per occurrence of a generated token
    repetition_penalty: float = 1.0  # > 0 (vLLM's): divides positive / multiplies negative logits of seen tokens
    logprobs: int | None = None  # record the target's log-probabilities with this many alternatives; None: off
    min_tokens: int = 0  # vLLM's: no end-of-sequence token (nor stop string) before this many generated tokens

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in -2..2, got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in -100..100")
        if not (is_integer(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be a whole number >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise ValueError(f"top logprobs must be in 0..{MAX_TOP}, got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether the target's distribution differs from its raw one (the draft then needs the rules too)."""
        return bool(self.constraint or self.logit_bias or self.penalized or self.min_tokens)

    @property
    def active(self) -> bool:
        return self.changes_logits or self.logprobs is not None


class TokenRules:
    """One sequence's rules state. Not thread-safe: each worker keeps its own (`fork`)."""

    def __init__(self, config: RulesConfig, vocab_size: int, matcher=None, prompt: Sequence[int] = (),
                 record: bool = True, eos: Sequence[int] = ()):
        self.config, self.vocab_size, self.matcher = config, vocab_size, matcher
        self.eos = tuple(i for i in eos if 0 <= i < vocab_size)  # masked before min_tokens
        # the prompt's distinct ids, sorted: only the repetition penalty reads them
        self.prompt = tuple(sorted(set(prompt))) if config.repetition_penalty != 1.0 else ()
        self.history: list[int] = []  # accepted tokens, in order
        # per token of `history`, whether the grammar allowed it alone (the committed rules only: a draft's fork
        # does not ask; Step.origin "forced")
        self.forced_flags: list[bool] | None = [] if record and matcher is not None else None
        self.counts: Counter = Counter()  # of `history`
        self.logprobs: list[TokenLogprob] | None = [] if record and config.logprobs is not None else None
        self._on_device: dict = {}  # (what, device) -> ids tensor: the prompt's distinct ids, the EOS ids

    @classmethod
    def create(cls, config: RulesConfig, tokenizer, vocab_size: int, prompt: Sequence[int]) -> TokenRules | None:
        """The rules of a request (None when it asks for none); ValueError for a grammar that cannot run."""
        if not config.active:
            return None
        if any(not 0 <= i < vocab_size for i, _ in config.logit_bias):
            raise ValueError(f"logit_bias names a token id outside the vocabulary (0..{vocab_size - 1})")
        matcher = None
        if config.constraint is not None:
            matcher = grammar.new_matcher(config.constraint, grammar.grammar_tokenizer(tokenizer, vocab_size))
        return cls(config, vocab_size, matcher, prompt, eos=tokenizer.eos_token_ids)

    @property
    def changes_logits(self) -> bool:
        return self.config.changes_logits

    def fork(self) -> TokenRules:
        """A copy at the same state that records no log-probabilities (a draft's)."""
        copy = TokenRules(self.config, self.vocab_size, self.matcher.deep_copy() if self.matcher else None,
                          self.prompt, record=False, eos=self.eos)
        copy.history, copy.counts = list(self.history), Counter(self.counts)
        return copy

    def apply(self, logits):
        """Processed logits [vocab] of one position at the current state (logits unchanged when no rule
        changes them); host arrays come back as CPU tensors, device tensors stay on their device."""
        if not self.changes_logits:
            return logits
        x, c = as_tensor(logits), self.config
        if c.logit_bias:
            x = add_bias(x, c.logit_bias)
        if c.penalized:
            seen = self._ids_on("prompt", self.prompt, x.device) if self.prompt else None
            x = penalize(x, self.counts, seen, c.repetition_penalty, c.frequency_penalty,
                         c.presence_penalty)
        if len(self.history) < c.min_tokens and self.eos and not self.finished():  # (a grammar's end wins)
            x = x.index_fill(0, self._ids_on("eos", self.eos, x.device), -float("inf"))
        if self.matcher is not None:
            bits = grammar.token_mask(self.matcher, self.vocab_size)  # an error here leaves no token allowed
            if self.matcher.is_error():
                raise grammar.GrammarError(f"the grammar failed: {grammar.one_line(self.matcher.get_error())}")
            x = grammar.mask_logits(x, bits)
        return x

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (and no change) when the grammar forbids it."""
        alone = self.forced_flags is not None and self.forced()[:1] == [int(token)]
        if self.matcher is not None and self.matcher.try_consume_tokens([int(token)]) != 1:
            return False
        if self.forced_flags is not None:
            self.forced_flags.append(alone)
        self.history.append(int(token))
        self.counts[int(token)] += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if n <= 0:
            return
        if self.matcher is not None:
            self.matcher.rollback(n)
        for token in self.history[-n:]:
            self.counts[token] -= 1
        del self.history[-n:]
        if self.forced_flags is not None:
            del self.forced_flags[-n:]

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, in order ([] when none or no grammar)."""
        return [] if self.matcher is None or self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    def only_allowed(self) -> int | None:
        """The one token the grammar allows next (a complete grammar's end-of-sequence), else None."""
        if self.matcher is None:
            return None
        ids = np.flatnonzero(grammar.allowed_tokens(grammar.token_mask(self.matcher, self.vocab_size),
                                                    self.vocab_size))
        return int(ids[0]) if len(ids) == 1 else None

    def finished(self) -> bool:
        """Whether only end-of-sequence may follow (the grammar is complete)."""
        return self.matcher is not None and self.matcher.is_stopped()

    def record(self, rows, tokens: Sequence[int]) -> None:
        """Keep the log-probabilities of committed `tokens` from the raw target logits `rows` [n, vocab]."""
        if self.logprobs is not None:
            self.logprobs += token_logprobs(rows, tokens, self.config.logprobs)

    def _ids_on(self, what: str, ids: Sequence[int], device) -> torch.Tensor:
        """`ids` as a long tensor on `device`, made once per (what, device)."""
        key = (what, device)
        if key not in self._on_device:
            torch = import_torch()
            self._on_device[key] = torch.tensor(list(ids), dtype=torch.long, device=device)
        return self._on_device[key]


def verify_rows(rules: TokenRules | None, logits, tokens: list[int]):
    """Target verify rows [k+1, vocab] (raw logits over [last, d_1..d_k]) processed at the committed state plus
    window[:j]. Returns (rows [k'+1, vocab], window [k'], advanced): the rules are left `advanced` tokens past the
    committed state. A window token the grammar refuses ends the window, with p = 0 at its row."""
    if rules is None or not rules.changes_logits:
        return logits, tokens, 0
    rows, advanced = [], 0
    for j in range(len(tokens) + 1):
        rows.append(rules.apply(logits[j]))
        if j == len(tokens):
            break
        if not rules.accept(tokens[j]):
            rows.append(rows[-1])  # a placeholder: the verdict stops at row j
            tokens = tokens[:j + 1]
            break
        advanced += 1
    return stack_rows(rows), tokens, advanced


def settle(rules: TokenRules | None, advanced: int, tokens: list[int], verdict, logits) -> None:
    """After a verdict: roll back to the accepted prefix, accept the correction or bonus, and record
    the target's log-probabilities of the committed tokens (from the raw `logits` [k+1, vocab])."""
    if rules is None:
        return
    accepted = verdict.num_accepted
    keep = min(advanced, accepted)
    rules.rollback(advanced - keep)
    for token in tokens[keep:accepted] + [verdict.next_token]:
        rules.accept(token)
    rules.record(logits, tokens[:accepted] + [verdict.next_token])


def add_bias(x: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """x [vocab] plus `bias` at its ids (a new tensor; ids past x's rows: a draft's embedding with less padding)."""
    torch = import_torch()
    bias = [(i, b) for i, b in bias if i < x.shape[-1]]
    ids = torch.tensor([i for i, _ in bias], dtype=torch.long, device=x.device)
    values = torch.tensor([b for _, b in bias], dtype=x.dtype, device=x.device)
    return x.index_add(0, ids, values)


def penalize(x: torch.Tensor, counts: Mapping[int, int], seen: torch.Tensor | None, repetition: float,
             frequency: float, presence: float) -> torch.Tensor:
    """x [vocab] (never modified in place) with the penalties for `counts` {id: times generated} and `seen` (the
    prompt's distinct ids on x's device, or None). Example: logits [2.0, -1.0, 0.5], counts {0: 2}, repetition 2,
    frequency 0.5, presence 1 -> token 0: 2.0 / 2 - 0.5 * 2 - 1 = -1.0; the others unchanged."""
    torch = import_torch()
    counts = {i: c for i, c in counts.items() if c}
    if repetition != 1.0:
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        if seen is not None:
            ids = torch.cat([ids, seen])
        if ids.numel():
            chosen = x[ids]
            x = x.index_put((ids,), torch.where(chosen > 0, chosen / repetition, chosen * repetition))
    if counts and (frequency or presence):
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        amount = torch.tensor([frequency * c + presence for c in counts.values()], dtype=x.dtype, device=x.device)
        x = x.index_add(0, ids, -amount)
    return x
