"""A speculative step of the batch: Mirror (the draft worker precomputes while the target verifies) or sd.

`MirrorStep.step`, one sequence at a time, in phases: 0. early exit to target-only if the draft failed; 1. take
the draft's next window; 2. verify (prefix, early exit sent to the draft, suffix, verdict); 3. accept, reuse or
roll back. sd (`MirrorStep.sd`) drafts and verifies in the decoder's thread. Both give the target's own text
(runtime.acceptance); a failed draft loses or duplicates no token.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mirror_rt.runtime.acceptance import verify
from mirror_rt.runtime.affinity import placed
from mirror_rt.runtime.batch.verify import BatchVerify
from mirror_rt.runtime.mirror.draft_row import DraftConfig, DraftRow, DraftStats, Line
from mirror_rt.runtime.mirror.draft_worker import DraftFailure, DraftWorker
from mirror_rt.runtime.mirror.messages import EarlyExit, Fault, Grow, Join, Leave, Move, Verdict, Window
from mirror_rt.runtime.mirror.stats import TargetCounters
from mirror_rt.runtime.transfer import PendingRead


@dataclass
class MirrorLink:
    """A sequence's target side while it is joined to the draft worker."""

    timeout_s: float  # a draft silent this long is declared dead
    ahead: bool  # the target computes while the host goes on: its suffix is queued before the exit is read
    alive: bool = True  # False once its draft failed: target-only from then on
    suffix_s: float = 0.0  # running mean of the suffix (tells the draft when to expect the verdict)
    exit_ids: object = None  # a batched step's early-exit ids of the window in flight (corrections' coverage)
    wait_s: float = 0.0  # running mean of the rendezvous wait (the draft is the bottleneck when it is large)
    q: tuple | None = None  # the window in flight's draft distributions (rejection sampling; else None)
    counters: TargetCounters = field(default_factory=TargetCounters)


class MirrorStep:
    """Speculative steps of the decoder's sequences, and the draft worker Mirror sequences share."""

    def __init__(self, decoder, cpus: tuple[int, int] | None = None):
        self.decoder = decoder
        self.cpus = cpus  # (target core, draft core) when each worker has one core of its own
        self.worker: DraftWorker | None = None
        self.draft_config = DraftConfig()  # the draft rows' runtime-internal knobs
        self.batch = BatchVerify(self)  # pooled steps: every row's window verified in one target call

    def run(self, running: list, gamma: int, spread: bool = False) -> None:
        """One step of each running sequence: Mirror for mirror sequences on a split target, sd for the others, one
        target-only token for ar sequences and those with one token left; in pools, every row in one target call
        (runtime.batch.verify), else one sequence at a time. `spread`: one pooled sequence's step on every core
        (the load policy's choice, runtime.batch.policy SPREAD; 2+ sequences spread wherever they can)."""
        d = self.decoder
        # a target that computes while the host goes on (CUDA) keeps the per-sequence step, which queues its suffix
        # before reading the early exit back (the batched prefix reads its exits first)
        pooled = d.pooled and not d.target.capabilities.asynchronous
        spread = pooled and (spread or self.batch.spreads(running))
        # a spread step runs on every core: the native ops of its target's wide call split over the cores its
        # thread may run on (exporters/pool_attention.cpp split_threads), so that thread is not Mirror's target's
        with placed(d.target, self.every_core() if spread else self.cpus[0] if self.cpus else None):
            if pooled:
                return self.batch.run(running, gamma, spread)
            for seq in running:
                k = min(gamma, seq.config.gamma, seq.remaining - 1)
                with seq.alone():
                    if seq.config.mode == "ar" or k < 1:
                        d.ar.one(seq)
                    elif seq.config.mode == "mirror" and d.target.capabilities.split:
                        self.step(seq, k)
                    else:
                        self.sd(seq, k)

    def every_core(self) -> tuple[int, ...] | None:
        """The target's and the draft's cores together (None: not pinned)."""
        if not self.cpus:
            return None
        return tuple(sorted({core for side in self.cpus for core in ((side,) if isinstance(side, int) else side)}))

    def step(self, seq, k: int) -> None:
        """One Mirror step of `seq`: a window of at most `k` draft tokens verified, the next one precomputed."""
        link, target, cache = self._link(seq), self.decoder.target, seq.target_cache
        # Phase 0: early exit: a sequence whose draft failed decodes target-only from here (nothing is lost)
        window = self._window(seq, link, k) if link.alive else None
        if window is None:
            link.counters.fallback_steps += 1
            with seq.metrics.stage("target_alone"):
                return self.decoder.ar.one(seq)
        # Phase 1 (`_window`): the draft's next window, from its outbox (the rendezvous), continuing the text
        # Phase 2: verify. The prefix layers and their early exit, sent to the draft at once (a device target queues
        # its suffix first, so it computes while the exit's few ids travel back); the suffix; the verdict
        t0 = time.perf_counter()
        with seq.metrics.stage("target_prefix"):
            exit_rows = self._prefix(seq, link, [seq.last, *window])
            queued = target.forward_suffix(cache) if link.ahead else None  # [k+1, vocab] on the device
            ids, logprobs = exit_rows.result() if link.ahead else exit_rows
        self.worker.send(seq.id, EarlyExit(seq.length, tuple(window), ids, logprobs, link.suffix_s))
        t1 = time.perf_counter()
        with seq.metrics.stage("target_suffix"):
            logits = target.forward_suffix(cache) if queued is None else queued  # [k+1, vocab]
            verdict = verify(logits, window, seq.length, seq.config.sampling, seq.config.seed, seq.rules, link.q)
        t2 = time.perf_counter()
        link.suffix_s = 0.8 * link.suffix_s + 0.2 * (t2 - t1) if link.suffix_s else t2 - t1
        link.counters.busy.append((t0, t2))
        seq.metrics.durations.setdefault("target_verify", []).append(t2 - t0)
        # Phase 3: accept, reuse or roll back. The draft takes the verdict (`take_verdict`): it reuses the line or
        # side branch that predicted it, or restarts from the corrected text; the target keeps [last] + accepted
        cache.rollback(seq.length + verdict.num_accepted)
        self.worker.send(seq.id, verdict)
        accepted = verdict.num_accepted
        if accepted < len(window) and ids.shape[1]:  # a correction: was it among the early exit's candidates?
            link.counters.corrections += 1
            link.counters.exit_covered += int(verdict.next_token in ids[accepted])
        seq.metrics.record_step(len(window), accepted)
        seq.commit([*window[:accepted], verdict.next_token], len(window), accepted)

    def sd(self, seq, k: int) -> None:
        """One vanilla speculative step of `seq`: its draft drafts `k` tokens in this thread, the target verifies
        them in one call, the draft takes the verdict."""
        row, target = self._sd_row(seq), self.decoder.target
        with seq.metrics.stage("draft_propose"):
            window = row.draft_window(k)
        with seq.metrics.stage("target_verify"):
            logits = target.forward([seq.last, *window], seq.target_cache)  # [k+1, vocab]
            verdict = verify(logits, window, seq.length, seq.config.sampling, seq.config.seed, seq.rules,
                             row.window_q())
        seq.target_cache.rollback(seq.length + verdict.num_accepted)
        take_verdict(row, verdict)
        row.trim()  # nothing speculative stays in the draft's cache (target-only steps may come next)
        seq.metrics.record_step(len(window), verdict.num_accepted)
        seq.commit([*window[:verdict.num_accepted], verdict.next_token], len(window), verdict.num_accepted)

    def _sd_row(self, seq) -> DraftRow:
        """The sequence's draft row for sd (made at its first sd step), caught up on the committed text."""
        d, text = self.decoder, seq.prompt + seq.tokens
        cache = d.prefill.draft_cache(seq)
        if seq.draft_row is None:
            seq.draft_row = DraftRow(d.draft or d.target, cache, text, seq.config, self.draft_config,
                                     rules=draft_rules(seq.rules))
        seq.draft_row.catch_up(text)
        return seq.draft_row

    def _window(self, seq, link: MirrorLink, k: int) -> list[int] | None:
        """The draft's next window, at most `k` tokens continuing the committed text; None when the draft failed,
        stalled or sent something else (the sequence then goes on target-only, said in its events)."""
        t0 = time.perf_counter()
        try:
            with seq.metrics.stage("target_wait"):
                message = self.worker.take(seq.id, link.timeout_s)
            link.wait_s = 0.8 * link.wait_s + 0.2 * (time.perf_counter() - t0)
            check_window(message, seq.length, seq.config.gamma, self.decoder.target.vocab_size)
        except DraftFailure as failure:
            link.alive = False
            seq.metrics.events.append(f"fallback to target-only: {failure}")
            self.worker.send(seq.id, Leave())
            return None
        link.q = None if message.q is None else message.q[:k]
        return list(message.tokens[:k])

    def wants_exit(self, seq, link: MirrorLink) -> bool:
        """Whether this step's early exit can pay off (`auto`: not while the draft is the bottleneck, it has no time
        to roll out side branches)."""
        mode = seq.config.early_exit
        return mode == "on" or (mode == "auto" and link.wait_s <= 0.25 * link.suffix_s)

    def send_exit(self, seq, window: list[int], ids, logprobs, counted: bool) -> None:
        """A batched step's early exit of `seq`'s window [T, kappa] (`counted`: computed, not [T, 0]), to the draft
        worker before the suffix runs."""
        seq.mirror.counters.exit_steps += counted
        seq.mirror.exit_ids = ids
        self.worker.send(seq.id, EarlyExit(seq.length, tuple(window), ids, logprobs, seq.mirror.suffix_s))

    def send_verdict(self, seq, verdict: Verdict, t0: float, suffix_s: float) -> None:
        """A batched step's verdict on `seq`'s window (verified from t0 on, its suffix `suffix_s`), to the draft
        worker; the target's counters."""
        link, t2 = seq.mirror, time.perf_counter()
        link.suffix_s = 0.8 * link.suffix_s + 0.2 * suffix_s if link.suffix_s else suffix_s
        link.counters.busy.append((t0, t2))  # (its target_verify duration: recorded once, by the batched verify)
        self.worker.send(seq.id, verdict)
        ids, link.exit_ids = link.exit_ids, None
        if ids is not None and verdict.num_accepted < ids.shape[0] - 1 and ids.shape[1]:  # a correction
            link.counters.corrections += 1
            link.counters.exit_covered += int(verdict.next_token in ids[verdict.num_accepted])

    def sd_verdict(self, seq, verdict: Verdict) -> None:
        """A batched step's verdict on `seq`'s sd window, taken by its draft row (nothing speculative stays)."""
        take_verdict(seq.draft_row, verdict)
        seq.draft_row.trim()

    def _prefix(self, seq, link: MirrorLink, tokens: list[int]):
        """The prefix layers, with the early-exit candidates while they can pay off ([T, 0] when not)."""
        target, cache = self.decoder.target, seq.target_cache
        if self.wants_exit(seq, link):
            link.counters.exit_steps += 1
            return target.launch_prefix(tokens, cache) if link.ahead else target.forward_prefix(tokens, cache)
        target.forward_prefix_only(tokens, cache)
        empty = np.zeros((len(tokens), 0))
        rows = (empty.astype(np.int64), empty)
        return PendingRead(*rows) if link.ahead else rows  # (host arrays: read already)

    # --- sequences joining and leaving the draft worker --------------------------------------

    def _link(self, seq) -> MirrorLink:
        """The sequence's side of the draft worker, joined at its first Mirror step (its draft cache is the draft
        thread's from then on)."""
        if seq.mirror is None:
            d = self.decoder
            if self.worker is None or not self.worker.thread.is_alive():
                pool = d.draft_pool if d.draft is not None else None  # (the oracle draft has caches of its own)
                self.worker = DraftWorker(d.draft or d.target, self.cpus[1] if self.cpus else None, handle,
                                          take_verdict, pool)
            self.worker.join(seq.id, Join(d.prefill.draft_cache(seq), seq.prompt + seq.tokens, seq.config,
                                          self.draft_config, draft_rules(seq.rules)))
            seq.mirror = MirrorLink(seq.config.draft_timeout_s, d.target.capabilities.asynchronous)
        return seq.mirror

    def drafting(self) -> bool:
        """Whether the draft worker holds any sequence now (its core is then busy: prompts take one core)."""
        return self.worker is not None and bool(self.worker.outboxes)

    def leave(self, seq) -> None:
        """The sequence stops speculating with the worker (finished, or the batch turns target-only)."""
        if seq.mirror is None:
            return
        stats = None
        if self.worker is not None:  # else stopped already, and the draft row with it
            self.worker.call(seq.id, Leave(), seq.config.draft_timeout_s)
            stats = self.worker.finished.pop(seq.id, None)
        seq.mirror_parts.append((stats or DraftStats(), seq.mirror.counters))
        seq.mirror = None

    def move(self, seq, pool, dest: int) -> bool:
        """Move a joined sequence's draft row through the worker (in order with its work); False if not joined."""
        if seq.mirror is None or self.worker is None:
            return False
        self.worker.call(seq.id, Move(pool, dest), seq.config.draft_timeout_s)
        return True

    def grow(self, pool, positions: int) -> None:
        """Grow the draft's pool: through the worker while it runs (in order with its forwards), else here."""
        if self.worker is not None and self.worker.thread.is_alive():
            message = Grow(pool, positions)
            self.worker.call(None, message)
            if message.done.is_set():
                return
        pool.grow(positions)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


# --- the draft's side (in the draft worker's thread) -----------------------------------------------

def handle(row: DraftRow, message) -> None:
    """A Mirror message for a draft row: an early exit (the roots of side branches), or a verdict, taken, after
    which the next window goes out at once (precomputed: a reuse; else drafted now, on the critical path)."""
    if isinstance(message, EarlyExit):
        row.take_exit(message)
    elif isinstance(message, Verdict):
        take_verdict(row, message)
        row.send_window(reused=bool(row.line.tokens))


def take_verdict(row: DraftRow, verdict: Verdict) -> None:
    """The draft's side of phase 3: the committed text grows by the accepted tokens and c; the main line continues
    if it predicted c (a main-line hit), a side branch rooted at (A, c) becomes the line (a side hit), else the line
    restarts from the corrected text (a miss). The window cap adapts to acceptance."""
    a, c, line = verdict.num_accepted, verdict.next_token, row.line
    if row.in_flight:
        row.acceptance = 0.9 * row.acceptance + 0.1 * (a / row.in_flight)
        if row.settings.adaptive_gamma:
            full = a == row.in_flight
            row.k_cap = min(row.config.gamma, row.k_cap + 2) if full else max(1, row.k_cap - 1)
    row.commit([*line.tokens[:a], c])
    if len(line.tokens) > a and line.tokens[a] == c:  # main-line hit (its rules are already past these tokens)
        row.line = line.rest(a + 1)
        row.stats.main_hits += bool(row.line.tokens)
        row.stats.not_ready += not row.line.tokens
    elif (a, c) in row.branches:  # side hit
        row.line = row.branches[(a, c)]
        row.stats.side_hits += 1
    else:  # miss, or the line never reached the bonus
        row.stats.not_ready += len(line.tokens) <= a
        row.stats.misses += len(line.tokens) > a
        row.line = Line(rules=row.fork_rules())
    row.branches, row.exit_rows, row.verdict_due = {}, None, 0.0


def draft_rules(rules):
    """The draft's copy of a sequence's token rules (None when they leave the logits as they are)."""
    return rules.fork() if rules is not None and rules.changes_logits else None


def check_window(window, length: int, gamma: int, vocab_size: int) -> None:
    """DraftFailure unless `window` is a window of 1..gamma ids in the vocabulary continuing the committed text."""
    if isinstance(window, Fault):
        raise DraftFailure(f"draft failed: {window.reason}")
    if not isinstance(window, Window):
        raise DraftFailure(f"draft sent {type(window).__name__}, expected a window")
    if window.base_length != length:
        raise DraftFailure(f"draft window continues length {window.base_length}, committed is {length}")
    if not 1 <= len(window.tokens) <= gamma:
        raise DraftFailure(f"draft window has {len(window.tokens)} tokens, expected 1..{gamma}")
    if any(not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size) for t in window.tokens):
        raise DraftFailure("draft window has token ids outside the vocabulary")

