"""The Mirror-SD draft worker: precompute the next window while the target verifies this one.

State: the committed text S (known from verdicts), the **line** X = the draft's own guesses
after S (the window in flight, then its guess for the bonus, then the next window), and
side **branches** {(depth j, root r): continuation}. The draft KV cache mirrors a token list
(`cache_tokens`); any context is reached by rolling back to the longest common prefix and
feeding the rest in one forward, so switching between branches costs one forward.

Work order between verdicts, one draft forward at a time, the inbox checked between forwards:
1. extend the line up to (window in flight) + 1 + gamma tokens: the full-acceptance branch;
2. roll out side branches ranked by `branches.rank_roots`, within the branch budget;
3. idle until the verdict.
On the verdict (A, c): the line continues if X[A] == c (a main-line hit), a stored branch
(A, c) becomes the line (a side hit), else the line restarts from the corrected text (a
miss); then up to gamma ready tokens are sent at once, or fresh ones are drafted first.
Limitations: batch 1; the draft shares the target's vocabulary.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from mirror_rt.runtime.affinity import pin
from mirror_rt.runtime.branches import exit_distribution, rank_roots, top_alternatives
from mirror_rt.runtime.draft_rules import confirm_greedy, extend_forced, rules_at
from mirror_rt.runtime.lookup import lookup_guesses
from mirror_rt.runtime.messages import STOP, EarlyExit, Fault, Verdict, Window
from mirror_rt.runtime.reference import prefill_logits
from mirror_rt.runtime.sampling import SamplingConfig, choose, keyed_rng, stack_rows
from mirror_rt.runtime.token_rules import TokenRules
from mirror_rt.runtime.transfer import to_host


@dataclass(frozen=True)
class DraftSettings:
    """What the draft worker needs to know."""

    gamma: int  # maximum window length
    sampling: SamplingConfig  # must match the target's
    seed: int = 0
    branch_budget: int | None = None  # side branches per step; None = auto: forwards that fit before the verdict
    branch_length: int = 0  # tokens per side branch; 0 = gamma
    alternatives: int = 3  # draft alternatives kept per depth for ranking roots
    min_window: int = 1  # send a precomputed window once it has this many tokens
    adaptive_gamma: bool = True  # adapt the window cap online: +2 after a full accept, -1 after a reject
    cpu: int | None = None  # pin the worker thread to this core (Linux)
    lookup: int = 3  # greedy: prompt-lookup guesses checked per forward (runtime.lookup); 0 = off
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
    q: list = field(default_factory=list)  # per token q row [vocab] or None (greedy)
    rows: list = field(default_factory=list)  # per token the row it was chosen from: q, or logits when greedy
    guesses: list[int] = field(default_factory=list)  # SS stream guesses after the last token (unverified)
    rules: TokenRules | None = None  # the token rules at the line's context plus its tokens (None: no rules)

    def append(self, token: int, q, row) -> None:
        """Add one drafted token with its q (None when greedy) and the row it was chosen from."""
        self.tokens.append(token)
        self.q.append(q)
        self.rows.append(row)


class DraftWorker:
    """Runs in its own thread; talks to the target only through `inbox` and `outbox`."""

    def __init__(self, draft, prompt: list[int], capacity: int, settings: DraftSettings,
                 rules: TokenRules | None = None):
        self.draft, self.settings = draft, settings
        self.rules = rules  # the token rules at the committed text (None: the request has none)
        self.refused: set[tuple[int, int]] = set()  # branch roots the grammar forbids (this step)
        self.prompt, self.capacity = list(prompt), capacity
        self.inbox: queue.Queue = queue.Queue(maxsize=8)
        self.outbox: queue.Queue = queue.Queue(maxsize=2)
        self.stats = DraftStats()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mirror-draft", daemon=True)
        self.committed: list[int] = []
        self.line = Line()
        self.in_flight = 0  # length of the window the target is verifying
        self.k_cap = settings.gamma  # current window cap (adapted online when adaptive_gamma)
        self.branches: dict[tuple[int, int], Line] = {}
        self.exit_rows = None
        self.verdict_due = 0.0  # when the verdict is expected (exit arrival + target suffix time)
        self.forward_s = 0.0  # running mean of one draft forward
        self.acceptance = 0.8  # running per-token acceptance estimate
        self.cache = None
        self.cache_tokens: list[int] = []

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it (a forward in progress finishes first)."""
        self.stop_event.set()
        try:
            self.inbox.put_nowait(STOP)
        except queue.Full:
            pass
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            if pin(self.settings.cpu) is not None and hasattr(self.draft, "set_threads"):
                self.draft.set_threads(1)  # one core each: the two workers must not contend
            if self.cache is None:  # else the cache came prefilled (adopted from the target)
                self.cache = self.draft.new_cache(self.capacity)
                prefill_logits(self.draft, self.prompt, self.cache)  # overlaps the target's prefill
            self.cache_tokens = list(self.prompt)
            start = self._get()
            if start is None:
                return
            self.committed = self.prompt + [start.first_token]
            self._commit_rules([start.first_token])
            self.line = Line(rules=self._fork())
            self._send_window(reused=False)
            while not self.stop_event.is_set():
                message = self._poll()
                if message is STOP:
                    return
                if message is not None:
                    self._handle(message)
                elif not self._speculate_one():
                    self._handle(self._get())
        except Exception as exc:  # noqa: BLE001 -- the target must hear of any failure, never hang on it
            self._put(Fault(f"{type(exc).__name__}: {exc}"))

    # --- messages ----------------------------------------------------------------------

    def _poll(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _get(self):
        while not self.stop_event.is_set():
            try:
                message = self.inbox.get(timeout=0.1)
                return None if message is STOP else message
            except queue.Empty:
                continue
        return None

    def _put(self, message) -> None:
        while not self.stop_event.is_set():
            try:
                self.outbox.put(message, timeout=0.1)
                return
            except queue.Full:
                continue

    def _handle(self, message) -> None:
        if message is None or message is STOP:
            self.stop_event.set()
        elif isinstance(message, EarlyExit):
            if message.base_length == len(self.committed):
                self.exit_rows = exit_distribution(message.ids, message.logprobs)
                self.verdict_due = time.perf_counter() + message.suffix_s
        elif isinstance(message, Verdict):
            self._apply_verdict(message)
            self._send_window(reused=bool(self.line.tokens))

    def _apply_verdict(self, verdict: Verdict) -> None:
        """Commit A window tokens and c; keep the line or a branch that predicted them."""
        a, c = verdict.num_accepted, verdict.next_token
        line = self.line
        if self.in_flight:
            self.acceptance = 0.9 * self.acceptance + 0.1 * (a / self.in_flight)
            if self.settings.adaptive_gamma:
                full = a == self.in_flight
                self.k_cap = min(self.settings.gamma, self.k_cap + 2) if full else max(1, self.k_cap - 1)
        self.committed += line.tokens[:a] + [c]
        self._commit_rules(line.tokens[:a] + [c])
        if len(line.tokens) > a and line.tokens[a] == c:  # the line's rules are already past these tokens
            self.line = Line(line.tokens[a + 1:], line.q[a + 1:], line.rows[a + 1:], line.guesses, line.rules)
            self.stats.main_hits += bool(self.line.tokens)
            self.stats.not_ready += not self.line.tokens
        elif (a, c) in self.branches:
            self.line = self.branches[(a, c)]
            self.stats.side_hits += 1
        else:
            self.stats.not_ready += len(line.tokens) <= a  # the line never reached the bonus
            self.stats.misses += len(line.tokens) > a
            self.line = Line(rules=self._fork())
        self.branches, self.exit_rows, self.verdict_due = {}, None, 0.0
        self.refused = set()

    def _commit_rules(self, tokens: list[int]) -> None:
        if self.rules is not None:
            for token in tokens:
                self.rules.accept(token)

    def _fork(self) -> TokenRules | None:
        """The rules at the committed text, for a line that starts there."""
        return None if self.rules is None else self.rules.fork()

    def _send_window(self, reused: bool) -> None:
        """Send up to gamma line tokens, drafting fresh ones first if fewer than min_window."""
        t0 = time.perf_counter()
        # sampling sends full windows: their length then never depends on timing, so a seed repeats exactly
        need = min(self.k_cap, max(1, self.settings.min_window)) if self.settings.sampling.greedy else self.k_cap
        while len(self.line.tokens) < need:
            self._extend(self.line, self.committed)
        self.stats.fresh_s += time.perf_counter() - t0
        k = min(self.k_cap, len(self.line.tokens))
        q = stack_rows(self.line.q[:k]) if not self.settings.sampling.greedy else None
        self.in_flight = k
        self.stats.windows += 1
        self._put(Window(len(self.committed), tuple(self.line.tokens[:k]), q, reused))

    # --- speculation ---------------------------------------------------------------------

    def _speculate_one(self) -> bool:
        """One draft forward of precomputation; False when there is nothing worth doing."""
        t0 = time.perf_counter()
        try:
            if len(self.line.tokens) < self._wanted(self.line):
                self._extend(self.line, self.committed)
                return True
            return self._grow_branch()
        finally:
            self.stats.rollout_s += time.perf_counter() - t0

    def _grow_branch(self) -> bool:
        settings, k = self.settings, self.in_flight
        for (depth, root), branch in self.branches.items():
            if len(branch.tokens) < self._wanted(branch) and (
                    settings.branch_budget is not None or self._fits_before_verdict()):
                self._extend(branch, self.committed + self.line.tokens[:depth] + [root])
                return True
        if settings.branch_budget is not None and len(self.branches) >= settings.branch_budget:
            return False
        if settings.branch_budget is None and not self._fits_before_verdict():
            return False
        window = self.line.tokens[:k]
        alternatives = [self._alternatives(row) for row in self.line.rows[:k + 1]]
        roots = rank_roots(window, self.line.tokens[k], alternatives, self.exit_rows, self.acceptance)
        root = next((r for r in roots if (r.depth, r.token) not in self.branches
                     and (r.depth, r.token) not in self.refused), None)
        if root is None:
            return False
        rules = rules_at(self.line, root.depth, root.token)
        if rules is False:  # the grammar forbids the root: the target can never correct to it
            self.refused.add((root.depth, root.token))
            return True
        branch = self.branches[(root.depth, root.token)] = Line(rules=rules)
        self.stats.branches_rolled += 1
        self._extend(branch, self.committed + window[:root.depth] + [root.token])
        return True

    def _wanted(self, line: Line) -> int:
        """Tokens worth drafting on `line`: the main line reaches past the window in flight, its bonus
        guess and the next window; a side branch holds one window."""
        if line is self.line:
            return self.in_flight + 1 + self.k_cap
        return self.settings.branch_length or self.settings.gamma

    def _fits_before_verdict(self) -> bool:
        """Auto budget: one more forward only if it should end before the verdict is due."""
        return self.exit_rows is not None and time.perf_counter() + self.forward_s <= self.verdict_due

    def _extend(self, line: Line, context: list[int]) -> None:
        """Draft one more token of `line` (several with SS streams or grammar-forced tokens), which continues
        `context`."""
        if line.rules is not None and extend_forced(line, self.settings.sampling.greedy, self.draft.vocab_size):
            self.stats.forced += 1
            return
        if self.settings.sampling.greedy and hasattr(self.draft, "forward_streams"):
            return self._extend_with_streams(line, context)
        if self.settings.sampling.greedy and self.settings.lookup:
            return self._extend_with_lookup(line, context)
        logits = self._logits_after(context + line.tokens)
        position = len(context) + len(line.tokens)  # keyed: the same token whenever this context is drafted
        row = logits if line.rules is None else line.rules.apply(logits)  # the draft's processed logits
        token, q = choose(row, self.settings.sampling, keyed_rng(self.settings.seed, 1, position))
        if line.rules is not None:
            line.rules.accept(token)
        line.append(token, q, row if q is None else q)

    def _extend_with_streams(self, line: Line, context: list[int]) -> None:
        """One SS forward: confirm the pending guesses (the streams' confident ones, else prompt-lookup's),
        add them and the next token, guess again."""
        full = context + line.tokens
        guesses = list(line.guesses) or self._lookup(line, full)
        streams, offset, n = self._feed_with_guesses(line, full, guesses, streams=True)
        line.guesses = confident_guesses(streams[offset + n], self.settings.stream_confidence)

    def _extend_with_lookup(self, line: Line, context: list[int]) -> None:
        """One forward with prompt-lookup guesses after the line (runtime.lookup); keeps the right ones."""
        full = context + line.tokens
        guesses = self._lookup(line, full)
        self.stats.guessed += len(guesses)
        _, _, n = self._feed_with_guesses(line, full, guesses)
        self.stats.guesses_kept += n

    def _lookup(self, line: Line, full: list[int]) -> list[int]:
        """Prompt-lookup guesses the line can still use after its next token ([] when lookup is off)."""
        room = min(self.settings.lookup, self._wanted(line) - len(line.tokens) - 1)
        return lookup_guesses(full, room) if room > 0 else []

    def _feed_with_guesses(self, line: Line, full: list[int], guesses: list[int], streams: bool = False):
        """Feed what the cache lacks of `full` (the line's context and tokens) plus `guesses`; append
        the next token and every confirmed guess to `line`.

        Returns (stream logits or None, the row predicting the token after `full`, guesses kept).
        """
        self._rollback_to_prefix(full)
        feed = full[len(self.cache_tokens):] + guesses
        out = self._feed(feed, streams=streams)
        main, stream_rows = out if streams else (out, None)
        offset = len(feed) - len(guesses) - 1  # the row that predicts the token after `full`
        n = confirm_greedy(line, main[offset:offset + len(guesses) + 1], guesses)
        if n < len(guesses):  # rejected guesses leave the cache
            self.cache.rollback(self.cache.length - (len(guesses) - n))
            del self.cache_tokens[self.cache.length:]
            self.stats.rollbacks += 1
        return stream_rows, offset, n

    def _alternatives(self, row) -> dict[int, float]:
        """The draft's most likely choices at one depth (derived only when roots are ranked)."""
        if not self.settings.alternatives or row is None:  # None: a grammar-forced token, no row
            return {}
        row = to_host(row)  # ranking roots runs on the host (a few rows per step)
        probs = row if not self.settings.sampling.greedy else _softmax(row)
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
        if streams:
            logits = self.draft.forward_streams(tokens, self.cache)
        else:
            logits = self.draft.forward(tokens, self.cache)
        t1 = time.perf_counter()
        self.stats.busy.append((t0, t1))
        self.stats.forwards += 1
        if len(tokens) == 1:  # one-token forwards: the unit of speculation work
            self.forward_s = 0.8 * self.forward_s + 0.2 * (t1 - t0) if self.forward_s else t1 - t0
        self.cache_tokens.extend(tokens)
        return logits


def confident_guesses(stream_rows: np.ndarray, min_probability: float) -> list[int]:
    """The streams' top tokens [n_s, vocab] -> the leading ones whose probability is >= min_probability.

    A guess costs a row of the next forward and saves a whole forward only when the draft confirms it,
    so an unlikely guess is not fed; a later stream's guess is useless without the earlier ones.
    Example: top probabilities (0.9, 0.1, 0.8) with min_probability 0.2 -> the first guess only.
    """
    guesses = []
    for row in np.asarray(stream_rows):  # float32 is enough: every exp(row - max) is in (0, 1]
        top = int(np.argmax(row))
        if 1.0 / np.exp(row - row[top]).sum() < min_probability:
            break
        guesses.append(top)
    return guesses


def _softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()
