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
from mirror_rt.runtime.affinity import on_two_cores
from mirror_rt.runtime.batch.splits import CoreSplit, balanced_cut
from mirror_rt.runtime.mirror.draft_batch import extend_lines, plain, wants

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
        self.split = CoreSplit()  # spread verifies: one call on every core, or two at once, by (rows, width)
        self.draft_split = CoreSplit()  # spread steps' drafting, the same choice by (rows, window)

    def run(self, running: list, gamma: int, spread: bool = False) -> None:
        """One step of `running`; `spread`: Mirror rows too draft as sd's do, on every core, and the target verifies
        on every core (`spreads`)."""
        plans = [plan for seq in running if (plan := self._plan(seq, gamma, spread)) is not None]
        SdDrafts(self.decoder, self.draft_split).draft([p for p in plans if p.way == SD],
                                                       self.mirror.cpus if spread else None)
        for plan in plans:
            plan.seq.metrics.spread_steps += spread and plan.way == SD
        plans = [p for p in plans if not p.seq.done]
        if not plans:
            return
        t0 = time.perf_counter()
        logits, suffix_s = self._forward(plans, spread)
        elapsed = time.perf_counter() - t0
        for plan in plans:
            with plan.seq.alone():
                self._settle(plan, logits[plan.seq.row], t0, elapsed, suffix_s)

    def spreads(self, running: list) -> bool:
        """Whether a step of `running` spreads over every core: always where it can and 2+ sequences run (their
        drafts share calls on both cores; `can_spread`)."""
        return len(running) > 1 and self.can_spread()

    def spreads_one(self, running: list) -> bool:
        """Whether one running sequence's step may spread over every core: the load policy measures it beside
        Mirror's divided cores and target-only decoding (runtime.batch.policy SPREAD)."""
        return len(running) == 1 and self.can_spread()

    def can_spread(self) -> bool:
        """A pooled target with sessions over every core (`wide`), a draft of the pool's rows, and a core per worker
        to spread over."""
        d = self.decoder
        return bool(d.pooled and d.target.capabilities.wide and d.draft is not None and self.mirror.cpus)

    def _plan(self, seq, gamma: int, spread: bool = False) -> Plan | None:
        """`seq`'s way this step and its window (the draft worker's for Mirror; sd's are drafted together later;
        `spread`: Mirror rows leave the worker and draft as sd's)."""
        k = min(gamma, seq.config.gamma, seq.remaining - 1)
        d, mirror = self.decoder, self.mirror
        if seq.config.mode == "ar" or k < 1:
            return Plan(seq, TARGET, [])
        if seq.config.mode != "mirror" or not d.target.capabilities.split or spread:
            mirror.leave(seq)  # (a Mirror row joined to the worker: its draft row is this thread's from now on)
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

    def _forward(self, plans: list[Plan], spread: bool = False) -> tuple[list, float]:
        """One target call over the rows from the first to the last planned one -> (logits [T, vocab] by row, None
        for rows outside the span; the seconds from the early exits sent to the logits); `spread`: on every core."""
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
        mirror_rows = [p for p in plans if p.way == MIRROR]
        if mirror_rows and d.target.capabilities.split_rows:
            pending, exit_rows = d.target.forward_rows_prefix(tokens, d.target_pool, first, exits)
            self._send_exits(mirror_rows, exit_rows, first)
            t0 = time.perf_counter()
            logits = d.target.forward_rows_suffix(pending, d.target_pool, first)
        else:  # no Mirror row, or a target that cannot split rows: one forward, no early exit
            self._send_exits(mirror_rows, {}, first)
            t0 = time.perf_counter()
            logits = self._spread_forward(tokens, first) if spread else d.target.forward_rows(tokens, d.target_pool,
                                                                                              first)
        return [None] * first + list(logits), time.perf_counter() - t0

    def _spread_forward(self, tokens: np.ndarray, first: int) -> np.ndarray:
        """A spread step's verify over rows first.. (tokens [B, T]) -> logits [B, T, vocab]: one call through the
        sessions over every core ("wide"), or two calls at once, one per core over each part of the rows ("split"),
        whichever `split` measured faster for this shape (a row's logits are the same bits either way)."""
        d, (rows, width) = self.decoder, tokens.shape
        key = (rows, width)
        able = d.target.capabilities.two_calls and rows >= 2
        way = self.split.way(key) if able else "wide"
        t0 = time.perf_counter()
        if way == "split":
            lengths = [int(d.target_pool.lengths[first + r]) + width for r in range(rows)]
            logits = d.target.forward_rows_split(tokens, d.target_pool, balanced_cut(lengths), self.mirror.cpus, first)
        else:
            logits = d.target.forward_rows(tokens, d.target_pool, first, wide=True)
        if able:
            self.split.record(key, way, time.perf_counter() - t0)
        return logits

    def _send_exits(self, plans: list[Plan], exit_rows: dict, first: int) -> None:
        """Each Mirror row's early exit ([T, 0] where none was computed: it still tells the draft when the verdict
        is due, so side branches grow meanwhile)."""
        for plan in plans:
            empty = np.zeros((1 + len(plan.window), 0))
            ids, logprobs = exit_rows.get(plan.seq.row - first, (empty.astype(np.int64), empty))
            self.mirror.send_exit(plan.seq, plan.window, ids, logprobs, counted=plan.exit)

    def _settle(self, plan: Plan, logits, t0: float, elapsed: float, suffix_s: float) -> None:
        """The row's verdict: its committed positions, its draft told, its tokens committed."""
        seq, d = plan.seq, self.decoder
        if plan.way == TARGET:
            d.target_pool.commit(seq.row, seq.length)
            d.ar.commit(seq, logits[0])
            return
        window = plan.window
        seq.metrics.add_stage("target_verify", elapsed)
        q = seq.mirror.q if plan.way == MIRROR else seq.draft_row.window_q()  # rejection sampling's q rows, or None
        verdict = verify(logits[:1 + len(window)], window, seq.length, seq.config.sampling, seq.config.seed, seq.rules,
                         q)
        accepted = verdict.num_accepted
        d.target_pool.commit(seq.row, seq.length + accepted)
        if plan.way == MIRROR:
            self.mirror.send_verdict(seq, verdict, t0, suffix_s)
        else:
            self.mirror.sd_verdict(seq, verdict)
        seq.metrics.record_step(len(window), accepted)
        seq.commit([*window[:accepted], verdict.next_token], len(window), accepted)


class SdDrafts:
    """sd rows' windows: one draft call per drafted position over every row that still drafts (runtime.mirror.
    draft_batch), or, given two cores, two such calls at once, one per core over each half of the rows, or one call
    through the draft's session over every core (one row always; more rows as `split` measured faster for their
    shape); rows whose drafting is no plain draw, or whose draft has no pool, draft alone."""

    def __init__(self, decoder, split: CoreSplit | None = None):
        self.decoder = decoder
        self.split = split  # the measured way (wide or split) of drafting rows on two cores, by (rows, window)

    def draft(self, plans: list[Plan], cpus: tuple | None = None) -> None:
        """Each plan's window (its size until now) drafted; `cpus` (this thread's cores, the helper's): on both."""
        d, together = self.decoder, []
        for plan in plans:
            row = plan.seq.draft_row
            with plan.seq.alone():
                if plain(row, row.line, d.draft, d.draft_pool):
                    together.append(plan)
                else:
                    with plan.seq.metrics.stage("draft_propose"):
                        plan.window = row.draft_window(plan.window[0])
        t0 = time.perf_counter()
        together.sort(key=lambda p: p.seq.row)
        half = len(together) // 2
        wide = bool(cpus) and d.draft.capabilities.wide  # (spread steps: every core)
        measured = bool(cpus and half and wide and self.split)  # both ways possible: the faster one
        shape = (len(together), max((p.window[0] for p in together), default=0))
        way = self.split.way(shape) if measured else "split" if cpus and half else "wide"
        if way == "split":  # contiguous halves of the rows: neither call pads a row the other writes
            on_two_cores(lambda: self._extend(together[:half]), lambda: self._extend(together[half:]), cpus)
        else:
            self._extend(together, wide=wide)
        if measured:
            self.split.record(shape, way, time.perf_counter() - t0)
        for plan in together:
            row = plan.seq.draft_row
            plan.seq.metrics.add_stage("draft_propose", time.perf_counter() - t0)
            row.in_flight = min(plan.window[0], len(row.line.tokens))
            plan.window = row.line.tokens[:row.in_flight]

    def _extend(self, drafting: list[Plan], wide: bool = False) -> None:
        """The plans' lines extended to their windows' sizes, one shared call per drafted position (`wide`: on every
        core)."""
        order = self.decoder.rows.order
        while drafting:
            drafting = [p for p in drafting if wants(p.seq.draft_row, p.seq.draft_row.line,
                                                     p.seq.draft_row.committed, p.window[0])]
            if drafting:  # (Mirror rows between them are the draft worker's: never written here)
                extend_lines(self.decoder.draft, self.decoder.draft_pool,
                             [(p.seq.draft_row, p.seq.draft_row.line, p.seq.draft_row.committed) for p in drafting],
                             lambda r: order[r].mirror is None,  # (runs join only gaps between their own rows)
                             **({"wide": True} if wide else {}))
