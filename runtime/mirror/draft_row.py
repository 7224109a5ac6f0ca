"""One sequence's draft state: Mirror precomputes its next window while the target verifies this one; sd drafts
its window in line (`draft_window`).

State: the committed text, the main **line** (the window in flight, a guess for the bonus, the next window) and
side **branches** {(depth, root): continuation}. Under rejection sampling every draft token is the draft's draw at
its own uniform for its position (stream DRAFT_DRAWS), and its q row goes with the window; under exact-seed it is
the draw at the target's uniform (runtime.sampling.choose_at). Under token rules a branch whose root the grammar
forbids is never rolled out; SS streams and prompt lookup step aside.
Limitation: the draft shares the target's vocabulary.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.mirror.branches import exit_distribution, rank_roots, top_alternatives
from mirror_rt.runtime.mirror.lookup import lookup_guesses, verify_guesses
from mirror_rt.runtime.mirror.messages import EarlyExit, Window
from mirror_rt.runtime.sampling import DRAFT_DRAWS, choose_at, draw_at, greedy_ids
from mirror_rt.runtime.token_rules import TokenRules
from mirror_rt.runtime.transfer import to_host


@dataclass(frozen=True)
class DraftConfig:
    """The draft worker's runtime-internal knobs; every user setting is the request's GenerationConfig."""

    adaptive_gamma: bool = True  # adapt the window cap in 1..gamma online: +2 after a full accept, -1 after a reject
    branch_length: int = 0  # tokens per side branch; 0 = gamma
    alternatives: int = 3  # draft alternatives kept per depth for ranking roots
    stream_confidence: float = 0.2  # SS drafts: feed a stream's guess only at this probability or more


@dataclass
class DraftStats:
    """Written by the draft thread only; read after it stopped."""

    windows: int = 0
    main_hits: int = 0
    side_hits: int = 0
    misses: int = 0  # the verdict matched no precomputed root
    not_ready: int = 0  # it matched, but no continuation token was drafted yet
    branches_rolled: int = 0
    forwards: int = 0  # draft forwards after prefill
    rollbacks: int = 0  # cache rollbacks (a cost of their own on stateful backends)
    guessed: int = 0  # prompt-lookup guesses fed
    guesses_kept: int = 0  # of them, confirmed by the draft's own greedy choice
    forced: int = 0  # tokens a grammar forced, drafted without a forward
    rollout_s: float = 0.0  # forwards before the verdict (overlapping the target)
    fresh_s: float = 0.0  # forwards after the verdict, before sending (critical path)
    busy: list[tuple[float, float]] = field(default_factory=list)  # forward intervals


@dataclass
class Line:
    """Draft tokens after some context, with what they need later."""

    tokens: list[int] = field(default_factory=list)
    rows: list = field(default_factory=list)  # per token the row it was chosen from (None: grammar-forced)
    q: list = field(default_factory=list)  # per token its draft distribution, rejection sampling (else None)
    guesses: list[int] = field(default_factory=list)  # SS stream guesses after the last token (unverified)
    rules: TokenRules | None = None  # the token rules at the line's context plus its tokens (None: no rules)
    ended: bool = False  # the grammar allows nothing after the line's tokens: nothing more to draft

    def rest(self, n: int) -> Line:
        """The line after its first `n` tokens (they were committed)."""
        return Line(self.tokens[n:], self.rows[n:], self.q[n:], self.guesses, self.rules, self.ended)


class DraftRow:
    """The draft side of one sequence: `extend_line` / `grow_branch` precompute, `send_window` delivers a window
    through `send` (the worker's), `take_exit` takes an early exit's roots; sd drafts a window with `draft_window`.
    Mirror's rows run in the draft worker's thread only."""

    def __init__(self, draft, cache, committed: list[int], config: GenerationConfig, settings: DraftConfig,
                 send=None, rules: TokenRules | None = None):
        self.draft, self.cache, self.config, self.settings, self.send = draft, cache, config, settings, send
        self.stats = DraftStats()
        self.committed = list(committed)  # prompt + output as far as the verdicts tell
        self.rules = rules  # the token rules at the committed text (None: the request has none)
        self.cache_tokens = self.committed[:cache.length]  # the tokens the draft cache holds (a prefix of them)
        self.line = Line(rules=self.fork_rules())
        self.in_flight = 0  # length of the window the target is verifying
        self.k_cap = config.gamma  # current window cap (adapted online when adaptive_gamma)
        self.branches: dict[tuple[int, int], Line] = {}
        self.exit_rows = None
        self.verdict_due = 0.0  # when the verdict is expected (exit arrival + target suffix time)
        self.forward_s = 0.0  # running mean of one draft forward
        self.acceptance = 0.8  # running per-token acceptance estimate

    def take_exit(self, message: EarlyExit) -> None:
        """The early exit of the window in flight: the roots side branches start from, and when the verdict is due."""
        if message.base_length == len(self.committed):
            self.exit_rows = exit_distribution(message.ids, message.logprobs)
            self.verdict_due = time.perf_counter() + message.suffix_s

    def draft_window(self, k: int) -> list[int]:
        """sd: the next window, `k` tokens of the line drafted now (fewer where the grammar or the context ends it)."""
        self.k_cap = k
        while len(self.line.tokens) < k and not self.line.ended:
            self._extend(self.line, self.committed)
        self.in_flight = min(k, len(self.line.tokens))
        return self.line.tokens[:self.in_flight]

    def window_q(self, k: int | None = None) -> tuple | None:
        """The draft distributions of the first `k` line tokens (default: the window in flight) under rejection
        sampling (None rows: one-hot, forced tokens); None otherwise (greedy and exact-seed windows carry none)."""
        if not self.config.rejection_sampling:
            return None
        return tuple(self.line.q[:self.in_flight if k is None else k])

    def catch_up(self, text: list[int]) -> None:
        """The committed text is now `text` (target-only steps added to it): the rules follow, the line restarts, and
        the cache holds a prefix of it (adopted positions included)."""
        if len(text) > len(self.committed):
            self.commit(text[len(self.committed):])
            self.line, self.branches = Line(rules=self.fork_rules()), {}
        self.cache_tokens = list(text[:self.cache.length])

    def trim(self) -> None:
        """Roll the cache back to the longest prefix it shares with the committed text (nothing speculative)."""
        self._rollback_to_prefix(self.committed + [-1])  # (-1: no token, so all of the text may stay)

    def commit(self, tokens: list[int]) -> None:
        """Committed text grows by `tokens` (a verdict's, or the first token); the rules follow it."""
        self.committed += tokens
        if self.rules is not None:
            for token in tokens:
                self.rules.accept(token)

    def fork_rules(self) -> TokenRules | None:
        """The rules at the committed text, for a line that starts there."""
        return None if self.rules is None else self.rules.fork()

    def send_window(self, reused: bool) -> None:
        """Send up to gamma line tokens, drafting fresh ones first if fewer than min_window."""
        t0 = time.perf_counter()
        # sampling sends full windows: their length then never depends on timing, so a seed repeats exactly
        need = min(self.k_cap, max(1, self.config.min_window)) if self.config.sampling.greedy else self.k_cap
        while len(self.line.tokens) < need and not self.line.ended:
            self._extend(self.line, self.committed)
        self.stats.fresh_s += time.perf_counter() - t0
        k = min(self.k_cap, len(self.line.tokens))
        self.in_flight = k
        self.stats.windows += 1
        self.send(Window(len(self.committed), tuple(self.line.tokens[:k]), reused, self.window_q(k)))

    # --- speculation ---------------------------------------------------------------------

    def line_short(self) -> bool:
        """Whether the main line lacks tokens for the window in flight, its bonus guess and the next window."""
        return len(self.line.tokens) < self._wanted(self.line) and not self.line.ended

    def extend_line(self) -> bool:
        """One more token (or several) of the main line."""
        self._extend(self.line, self.committed)
        return True

    def timed(self, work) -> bool:
        """Run one precomputation forward (`work`), its time counted as rollout."""
        t0 = time.perf_counter()
        try:
            return work()
        finally:
            self.stats.rollout_s += time.perf_counter() - t0

    def grow_branch(self) -> bool:
        """One forward of a side branch (a new root ranked first, or a started one); False within budget."""
        budget, k = self.config.branch_budget, self.in_flight
        for (depth, root), branch in self.branches.items():
            if len(branch.tokens) < self._wanted(branch) and not branch.ended and (
                    budget is not None or self._fits_before_verdict()):
                self._extend(branch, self.committed + self.line.tokens[:depth] + [root])
                return True
        if budget is not None and len(self.branches) >= budget:
            return False
        if budget is None and not self._fits_before_verdict():
            return False
        if len(self.line.tokens) <= k:  # an ended line has no guess past the window: nothing to branch beside
            return False
        window = self.line.tokens[:k]
        alternatives = [self._alternatives(row) for row in self.line.rows[:k + 1]]
        roots = rank_roots(window, self.line.tokens[k], alternatives, self.exit_rows, self.acceptance)
        root = next((r for r in roots if (r.depth, r.token) not in self.branches), None)
        if root is None:
            return False
        rules = self._rules_at(root.depth, root.token)
        branch = self.branches[(root.depth, root.token)] = Line(rules=rules or None, ended=rules is False)
        if rules is False:  # the grammar forbids the root: the target can never correct to it
            return True
        self.stats.branches_rolled += 1
        self._extend(branch, self.committed + window[:root.depth] + [root.token])
        return True

    def _wanted(self, line: Line) -> int:
        """Tokens worth drafting on `line`: the main line reaches past the window in flight, its bonus
        guess and the next window; a side branch holds one window."""
        if line is self.line:
            return self.in_flight + 1 + self.k_cap
        return self.settings.branch_length or self.config.gamma

    def _rules_at(self, depth: int, root: int):
        """The rules after the committed text, the line's first `depth` tokens and `root` (a side branch's
        start): None without rules, False when the grammar forbids the root."""
        if self.rules is None:
            return None
        rules = self.rules.fork()
        for token in self.line.tokens[:depth]:
            rules.accept(token)
        return rules if rules.accept(root) else False

    def _fits_before_verdict(self) -> bool:
        """Auto budget: one more forward only if it should end before the verdict is due."""
        return self.exit_rows is not None and time.perf_counter() + self.forward_s <= self.verdict_due

    def _extend(self, line: Line, context: list[int]) -> None:
        """Draft one more token of `line` (several with SS streams), which continues `context`."""
        if self._room(len(context) + len(line.tokens)) <= 0:
            line.ended = True  # past the context limit: no token the target could take (it caps its windows)
            return None
        if line.rules is not None:
            return self._extend_under_rules(line, context)
        if self.config.sampling.greedy and self.draft.capabilities.streams:
            return self._extend_with_streams(line, context)
        if self.config.sampling.greedy and self.config.draft_lookup:
            return self._extend_with_lookup(line, context)
        logits = self._logits_after(context + line.tokens)
        token, q = self._draw(logits, len(context) + len(line.tokens))
        _append(line, token, logits, q)

    def _draw(self, row, position: int) -> tuple[int, object]:
        """The draft's token at `position` from its (processed) logits row, and its q row: its own draw under
        rejection sampling, the target's uniform under exact-seed (coupled proposals: no q)."""
        sampling, seed = self.config.sampling, self.config.seed
        if not self.config.rejection_sampling:
            return choose_at(row, sampling, seed, position)[0], None
        ids, q = draw_at(row, sampling, seed, position, DRAFT_DRAWS)
        return ids[0], q[0]

    def _room(self, length: int) -> int:
        """Positions left after a text of `length` tokens for guesses fed with its last token: a forward never
        passes the context limit (an exported draft's rotary tables end there)."""
        return self.draft.max_seq_len - length

    def _extend_under_rules(self, line: Line, context: list[int]) -> None:
        """One token of `line` under its rules: the one the grammar forces (no forward), else the draft's draw
        from its processed logits; a line the grammar ends (nothing allowed after it) is marked ended."""
        rules = line.rules
        forced = rules.forced()[:1]  # one: what a state forces depends on that state alone
        if forced:
            rules.accept(forced[0])
            self.stats.forced += 1
            return _append(line, forced[0], None)
        finished = rules.finished()  # complete: only an end-of-sequence may follow, as the line's last token (the
        if finished:  # target's window then ends the text; with none drafted, an empty window was a draft fault)
            line.ended = True
            only = rules.only_allowed()
            if only is not None:  # drafted without a forward
                self.stats.forced += 1
                return _append(line, only, None)
        row = rules.apply(self._logits_after(context + line.tokens))
        token, q = self._draw(row, len(context) + len(line.tokens))
        if finished:  # a stopped matcher consumes nothing, so the mask alone says whether the draw is allowed
            if float(row[token]) != float("-inf"):
                _append(line, token, row, q)
            return None
        if not rules.accept(token):  # nothing the grammar allows (a masked-out row): stop drafting this line
            line.ended = True
            return None
        _append(line, token, row, q)

    def _extend_with_streams(self, line: Line, context: list[int]) -> None:
        """One SS forward: confirm the pending guesses (the streams' confident ones, else prompt-lookup's),
        add them and the next token, guess again."""
        full = context + line.tokens
        guesses = (list(line.guesses) or self._lookup(line, full))[:self._room(len(full))]
        streams, offset, n = self._feed_with_guesses(line, full, guesses, streams=True)
        line.guesses = confident_guesses(streams[offset + n], self.settings.stream_confidence)

    def _extend_with_lookup(self, line: Line, context: list[int]) -> None:
        """One forward with prompt-lookup guesses after the line (runtime.mirror.lookup); keeps the right ones."""
        full = context + line.tokens
        guesses = self._lookup(line, full)
        self.stats.guessed += len(guesses)
        _, _, n = self._feed_with_guesses(line, full, guesses)
        self.stats.guesses_kept += n

    def _lookup(self, line: Line, full: list[int]) -> list[int]:
        """Prompt-lookup guesses the line can still use after its next token ([] when lookup is off)."""
        room = min(self.config.draft_lookup, self._wanted(line) - len(line.tokens) - 1, self._room(len(full)))
        return lookup_guesses(full, room) if room > 0 else []

    def _feed_with_guesses(self, line: Line, full: list[int], guesses: list[int], streams: bool = False):
        """Feed what the cache lacks of `full` plus `guesses`; append the next token and every confirmed guess.
        Returns (stream logits or None, the row predicting the token after `full`, guesses kept)."""
        self._rollback_to_prefix(full)
        feed = full[len(self.cache_tokens):] + guesses
        out = self._feed(feed, streams=streams)
        main, stream_rows = out if streams else (out, None)
        offset = len(feed) - len(guesses) - 1  # the row that predicts the token after `full`
        n = verify_guesses(main[offset:], guesses)
        if n < len(guesses):  # rejected guesses leave the cache
            self.cache.rollback(self.cache.length - (len(guesses) - n))
            del self.cache_tokens[self.cache.length:]
            self.stats.rollbacks += 1
        rows = main[offset:offset + n + 1]
        for token, row in zip(greedy_ids(rows), rows):
            _append(line, token, row)
        return stream_rows, offset, n

    def _alternatives(self, row) -> dict[int, float]:
        """The draft's most likely choices at one depth (derived only when roots are ranked)."""
        if not self.settings.alternatives or row is None:  # None: a grammar-forced token, chosen from no row
            return {}
        x = np.asarray(to_host(row), dtype=np.float64)  # ranking roots runs on the host (a few rows per step)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        return top_alternatives(probs, self.settings.alternatives + 1)

    def _rollback_to_prefix(self, context: list[int]) -> None:
        """Keep the longest cached prefix of `context` that leaves its last token unfed."""
        n = min(len(self.cache_tokens), len(context) - 1)
        same = n
        if self.cache_tokens[:n] != context[:n]:  # compared in C; the common case is a plain extension
            same = int(np.argmax(np.asarray(self.cache_tokens[:n]) != np.asarray(context[:n])))
        if same < len(self.cache_tokens):
            self.cache.rollback(same)
            self.stats.rollbacks += 1
            del self.cache_tokens[same:]

    def _logits_after(self, context: list[int]) -> np.ndarray:
        """Logits of the token after `context`, reusing the longest cached prefix."""
        self._rollback_to_prefix(context)
        return self._feed(context[len(self.cache_tokens):])[-1]

    def _feed(self, tokens: list[int], streams: bool = False):
        """One draft forward (with SS stream logits when `streams`), timed and mirrored in cache_tokens."""
        t0 = time.perf_counter()
        logits = (self.draft.forward_streams if streams else self.draft.forward)(tokens, self.cache)
        t1 = time.perf_counter()
        self.stats.busy.append((t0, t1))
        self.stats.forwards += 1
        if len(tokens) == 1:  # one-token forwards: the unit of speculation work
            self.forward_s = 0.8 * self.forward_s + 0.2 * (t1 - t0) if self.forward_s else t1 - t0
        self.cache_tokens.extend(tokens)
        return logits


def _append(line: Line, token: int, row, q=None) -> None:
    """Add one drafted token with the row it was chosen from (None: forced by the grammar) and its draft
    distribution (None: not recorded, or a one-hot)."""
    line.tokens.append(token)
    line.rows.append(row)
    line.q.append(q)


def confident_guesses(stream_rows: np.ndarray, min_probability: float) -> list[int]:
    """The streams' top tokens [n_s, vocab] -> the leading ones whose probability is >= min_probability.
    Example: top probabilities (0.9, 0.1, 0.8) with min_probability 0.2 -> the first guess only."""
    guesses = []
    for row in np.asarray(stream_rows):  # float32 is enough: every exp(row - max) is in (0, 1]
        top = int(np.argmax(row))
        if 1.0 / np.exp(row - row[top]).sum() < min_probability:
            break
        guesses.append(top)
    return guesses
