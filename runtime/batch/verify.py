"""A speculative step of a pooled batch in one target call: every running sequence's row in the same forward.

Each row carries a ragged window: its last token, then its draft tokens (none for target-only rows: mode ar, the
last token, a failed draft), padded to the longest. Padding sits after a row's real positions, so causal attention
keeps it out of their logits, and its KV is never committed. A split target with `split_rows` runs the prefix over
every row, the early exit of the Mirror rows that want it (sent to the draft worker before the suffix), then the
suffix; sd rows' drafts take one draft call per drafted position over the rows that need it (`SdDrafts`). Every
token is still the target's own choice at its position (runtime.acceptance), whatever the batch.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mirror_rt.runtime.acceptance import verify
from mirror_rt.runtime.mirror.draft_row import _append
from mirror_rt.runtime.sampling import choose_at

SD, MIRROR, TARGET = "sd", "mirror", "target"


@dataclass
class Plan:
    """One running sequence's part of the step: its way and window."""

    seq: object
    way: str  # SD, MIRROR or TARGET (one target-only token)
    window: list
    exit: bool = False  # a Mirror row whose early exit goes to the draft worker


class BatchVerify:
    """Speculative steps of a pooled batch (runtime.mirror.step.MirrorStep keeps the draft worker and the
    per-sequence steps of targets with caches of their own)."""

    def __init__(self, mirror_step):
        self.mirror = mirror_step
        self.decoder = mirror_step.decoder
        self.target_calls = 0  # forwards of the target's rows (prefix + suffix count once)

    def run(self, running: list, gamma: int) -> None:
        plans = [plan for seq in running if (plan := self._plan(seq, gamma)) is not None]
        SdDrafts(self.decoder).draft([p for p in plans if p.way == SD])
        plans = [p for p in plans if not p.seq.done]
        if not plans:
            return
        t0 = time.perf_counter()
        logits, suffix_s = self._forward(plans)
        elapsed = time.perf_counter() - t0
        for plan in plans:
            with plan.seq.alone():
                self._settle(plan, logits[plan.seq.row], t0, elapsed, suffix_s)

    def _plan(self, seq, gamma: int) -> Plan | None:
        """`seq`'s way this step and its window (the draft worker's for Mirror; sd's are drafted together later)."""
        k = min(gamma, seq.config.gamma, seq.remaining - 1)
        d, mirror = self.decoder, self.mirror
        if seq.config.mode == "ar" or k < 1:
            return Plan(seq, TARGET, [])
        if seq.config.mode != "mirror" or not d.target.capabilities.split:
            with seq.alone():
                mirror._sd_row(seq).k_cap = k
                return Plan(seq, SD, [k])  # (the window's size until drafted)
            return None
        link = mirror._link(seq)
        window = mirror._window(seq, link, k) if link.alive else None
        if window is None:  # a failed draft: this row goes on target-only (nothing is lost)
            link.counters.fallback_steps += 1
            return Plan(seq, TARGET, [])
        return Plan(seq, MIRROR, window, exit=mirror.wants_exit(seq, link))

    def _forward(self, plans: list[Plan]) -> tuple[list, float]:
        """One target call over the rows from the first to the last planned one -> (logits [T, vocab] by row, None
        for rows outside the span; the seconds from the early exits sent to the logits)."""
        d = self.decoder
        rows = [p.seq.row for p in plans]
        first, last = min(rows), max(rows)
        width = max(1 + len(p.window) for p in plans)
        tokens = np.zeros((last - first + 1, width), dtype=np.int64)  # rows still prefilling: placeholders
        for plan in plans:
            row = [plan.seq.last, *plan.window]
            tokens[plan.seq.row - first, :len(row)] = row
            tokens[plan.seq.row - first, len(row):] = row[-1]
        exits = {p.seq.row - first: 1 + len(p.window) for p in plans if p.exit}
        self.target_calls += 1
        t0 = time.perf_counter()
        if any(p.way == MIRROR for p in plans) and d.target.capabilities.split_rows:
            pending, exit_rows = d.target.forward_rows_prefix(tokens, d.target_pool, first, exits)
            for plan in plans:
                if plan.exit:
                    self.mirror.send_exit(plan.seq, plan.window, *exit_rows[plan.seq.row - first])
            t0 = time.perf_counter()
            logits = d.target.forward_rows_suffix(pending, d.target_pool, first)
        else:  # no Mirror row, or a target that cannot split rows: one forward, no early exit
            logits = d.target.forward_rows(tokens, d.target_pool, first)
        return [None] * first + list(logits), time.perf_counter() - t0

    def _settle(self, plan: Plan, logits, t0: float, elapsed: float, suffix_s: float) -> None:
        """The row's verdict: its committed positions, its draft told, its tokens committed."""
        seq, d = plan.seq, self.decoder
        if plan.way == TARGET:
            d.target_pool.commit(seq.row, seq.length)
            d.ar.commit(seq, logits[0])
            return
        window = plan.window
        seq.metrics.add_stage("target_verify", elapsed)
        verdict = verify(logits[:1 + len(window)], window, seq.length, seq.config.sampling, seq.config.seed, seq.rules)
        accepted = verdict.num_accepted
        d.target_pool.commit(seq.row, seq.length + accepted)
        if plan.way == MIRROR:
            self.mirror.send_verdict(seq, verdict, t0, suffix_s)
        else:
            self.mirror.sd_verdict(seq, verdict)
        seq.metrics.record_step(len(window), accepted)
        seq.commit([*window[:accepted], verdict.next_token], len(window), accepted)


class SdDrafts:
    """sd rows' windows: one draft call per drafted position over every row that still drafts (a pooled draft),
    each row fed what its cache lacks (ragged, padded as the target's windows); rows whose drafting is not a plain
    draw (token rules, SS streams, prompt lookup) or whose draft has no pool draft alone."""

    def __init__(self, decoder):
        self.decoder = decoder

    def draft(self, plans: list[Plan]) -> None:
        """Each plan's window (its size until now) drafted."""
        together = []
        for plan in plans:
            with plan.seq.alone():
                if self._plain(plan.seq.draft_row):
                    together.append(plan)
                else:
                    with plan.seq.metrics.stage("draft_propose"):
                        plan.window = plan.seq.draft_row.draft_window(plan.window[0])
        t0, drafting = time.perf_counter(), together
        while drafting:
            drafting = [p for p in drafting if self._wants(p.seq.draft_row, p.window[0])]
            if drafting:
                self._forward(drafting)
        for plan in together:
            row = plan.seq.draft_row
            plan.seq.metrics.add_stage("draft_propose", time.perf_counter() - t0)
            row.in_flight = min(plan.window[0], len(row.line.tokens))
            plan.window = row.line.tokens[:row.in_flight]

    def _plain(self, row) -> bool:
        d, config = self.decoder, row.config
        streams = config.sampling.greedy and (row.draft.capabilities.streams or config.draft_lookup)
        return d.draft_pool is not None and row.draft is d.draft and row.line.rules is None and not streams

    @staticmethod
    def _wants(row, k: int) -> bool:
        """Whether the row's line needs another token for a window of `k` (and can have one)."""
        if len(row.line.tokens) >= k or row.line.ended:
            return False
        if row._room(len(row.committed) + len(row.line.tokens)) <= 0:
            row.line.ended = True  # past the context limit (as DraftRow._extend)
            return False
        return True

    def _forward(self, plans: list[Plan]) -> None:
        """One more token of each row's line: a draft call per contiguous run of the rows (Mirror rows between them
        belong to the draft worker's thread and are never written here)."""
        feeds = {}
        for plan in plans:
            row = plan.seq.draft_row
            context = row.committed + row.line.tokens
            row._rollback_to_prefix(context)
            feeds[plan.seq.row] = (plan, context[len(row.cache_tokens):])
        for first, count in self._runs(sorted(feeds)):
            width = max(len(feeds[r][1]) for r in range(first, first + count) if r in feeds)
            tokens = np.zeros((count, width), dtype=np.int64)
            for r in range(first, first + count):
                if r in feeds:
                    feed = feeds[r][1]
                    tokens[r - first, :len(feed)], tokens[r - first, len(feed):] = feed, feed[-1]
            t0 = time.perf_counter()
            logits = self.decoder.draft.forward_rows(tokens, self.decoder.draft_pool, first)
            t1 = time.perf_counter()
            for r in range(first, first + count):
                if r in feeds:
                    self._take(*feeds[r], logits[r - first], (t0, t1))

    def _runs(self, rows: list[int]) -> list[tuple[int, int]]:
        """Contiguous runs (first row, rows) covering `rows` and no row the draft worker holds."""
        order, runs = self.decoder.rows.order, []
        for row in rows:
            if runs and all(order[r].mirror is None for r in range(runs[-1][0] + runs[-1][1], row)):
                runs[-1] = (runs[-1][0], row - runs[-1][0] + 1)
            else:
                runs.append((row, 1))
        return runs

    def _take(self, plan: Plan, feed: list[int], logits, busy: tuple[float, float]) -> None:
        """The row's cache holds `feed` now; the draft's draw after it joins the line."""
        row, seq = plan.seq.draft_row, plan.seq
        self.decoder.draft_pool.commit(seq.row, row.cache.length + len(feed))
        row.cache_tokens.extend(feed)
        row.stats.forwards += 1
        row.stats.busy.append(busy)
        last = logits[len(feed) - 1]
        position = len(row.committed) + len(row.line.tokens)
        _append(row.line, choose_at(last, seq.config.sampling, seq.config.seed, position)[0], last)
