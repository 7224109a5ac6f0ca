"""The target-only steps of the batched decoder: prompts into their rows (`Prefill`), a step of every row (`ArStep`).

Every choice is the target's own at its position (runtime.sampling.choose_at), so every way of stepping gives the
same text. Speculative steps: runtime.mirror.step.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time

import numpy as np

from mirror_rt.runtime.batch.splits import balanced_cut
from mirror_rt.runtime.reference import choose_under

LIKE = 0.6  # two prompts' chunks prefill at once when the shorter is at least this share of the longer
LONG = 2  # chunks a prompt must still need before short prompts go ahead of it


class Prefill:
    """Prompts into their rows, one chunk per decoder step."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.pairs = 0  # steps that prefilled two prompts at once, one per core

    def start(self, seq) -> None:
        """Caches for a newly admitted sequence, and what the prefix cache already holds of its prompt."""
        d = self.decoder
        if d.pooled:
            seq.target_cache = d.target_pool.row_cache(seq.row)
            d.target_pool.commit(seq.row, 0)
        else:  # a cache of its own, as long as it may grow (a static window attends over all of its slots)
            seq.target_cache = d.target.new_cache(d.positions_needed(seq))
        seq.computed = 0
        if d.cache is not None:
            keys = d.cache.lookup(self.cache_tokens(seq))
            seq.reused = seq.computed = d.cache.load(d.target_pool, seq.row, keys)
            d.target_pool.commit(seq.row, seq.computed)
        seq.metrics.prompt_tokens = len(seq.prompt)

    @classmethod
    def cache_tokens(cls, seq) -> list[int]:
        """What the prefix cache is asked for: the positions to fill and the next one (its logits are computed)."""
        return cls.fill(seq) if not seq.tokens else cls.fill(seq) + [seq.last]

    @staticmethod
    def fill(seq) -> list[int]:
        """Positions the target cache must hold before decoding: the prompt (resumed: all but the last token)."""
        return seq.prompt + seq.tokens[:-1]

    def run(self) -> None:
        """Prompt positions up to one chunk's worth per step, in turn (`in_turn`), or a chunk each of two (`_pair`)."""
        budget = self.decoder.settings.prefill_chunk
        pending = self.in_turn()
        pair = self._pair(pending, budget)
        if pair:
            self._two_cores(*pair)
            return
        for seq in pending:
            if budget <= 0:
                return
            budget -= self._chunk(seq, budget)

    def in_turn(self) -> list:
        """The prompts still prefilling in the order they take the chunk: oldest first, but while a prompt needs more
        than LONG chunks, short ones go before it, up to half the chunk between them."""
        pending = [s for s in self.decoder.active if s.state == "prefill" and not s.done]
        chunk = self.decoder.settings.prefill_chunk
        if all(len(self.fill(s)) - s.computed <= LONG * chunk for s in pending):
            return pending
        half, first = chunk // 2, []
        for seq in pending:
            left = len(self.fill(seq)) - seq.computed
            if left <= half:
                first.append(seq)
                half -= left
        return first + [s for s in pending if s not in first]

    def _pair(self, pending: list, budget: int) -> tuple[list, list] | None:
        """The oldest prompt and the next whose chunk is at least LIKE times as long (or the other way), with their
        chunks, where the target can run two prompts at once on two cores and the draft worker idles."""
        d = self.decoder
        if len(pending) < 2 or not (d.target.capabilities.two_calls and d.pooled and d.mirror.cpus):
            return None
        if d.mirror.drafting():
            return None
        chunks = [self.fill(s)[s.computed:s.computed + budget] for s in pending]
        if len(chunks[0]) < 2:
            return None
        for seq, chunk in zip(pending[1:], chunks[1:]):
            shorter, longer = sorted((len(chunk), len(chunks[0])))
            if shorter >= 2 and shorter >= LIKE * longer:
                return [pending[0], seq], [chunks[0], chunk]
        return None

    def _two_cores(self, pair: list, chunks: list) -> None:
        """A chunk of each of the two prompts at once, one per core."""
        t0 = time.perf_counter()
        logits = self.decoder.target.prefill_split(chunks, [s.target_cache for s in pair],
                                                    self.decoder.mirror.cpus)
        elapsed = time.perf_counter() - t0
        for seq, chunk, last in zip(pair, chunks, logits):
            seq.metrics.add_stage("target_prefill", elapsed)
            self._advance(seq, chunk, last)
        self.pairs += 1

    def _chunk(self, seq, budget: int) -> int:
        """Up to `budget` positions of `seq`'s prompt into its row; returns how many."""
        d, fill = self.decoder, self.fill(seq)
        cache = seq.target_cache
        chunk = fill[seq.computed:seq.computed + budget]
        logits = None
        if chunk:  # empty only when a resumed sequence found all of it in the prefix cache
            with seq.metrics.stage("target_prefill"):
                logits = self._forward(chunk, cache, wide=len(chunk) > 1 and not d.mirror.drafting())
        return self._advance(seq, chunk, logits)

    def _advance(self, seq, chunk: list[int], logits) -> int:
        """After `chunk` went into `seq`'s row (`logits`: its last position's): the first token once the prompt
        is in, then the draft's row and the prefix cache; returns the positions the step spent on it."""
        d, fill = self.decoder, self.fill(seq)
        seq.computed += len(chunk)
        if seq.computed < len(fill):
            return len(chunk)
        if not seq.tokens:  # a new sequence: the prompt's last logits give its first token
            with seq.alone():
                first = choose_under(seq.rules, logits[-1], seq.config.sampling, seq.config.seed, len(seq.prompt))
                seq.metrics.first_token_at = time.perf_counter()
                seq.commit([first], 0, 0)
            if seq.done:
                return max(len(chunk), 1)
        self._draft_prefill(seq, fill)
        seq.state = "running"
        if d.cache is not None:
            d.cache.store(d.target_pool, seq.row, fill, limit=d.budget.spare)
        return max(len(chunk), 1)  # a prompt found whole in the prefix cache still costs its draft's prefill

    def _forward(self, chunk: list[int], cache, wide: bool):
        """The chunk's last logits [1, vocab]; on every core (a split target's prompt sessions) when `wide`."""
        target = self.decoder.target
        if wide and target.capabilities.pipelined:
            return target.prefill_pipelined(chunk, cache, None)
        return target.forward_last(chunk, cache)

    def _draft_prefill(self, seq, fill: list[int]) -> None:
        """The draft's cache: a pooled row starts empty (filled at the first speculative step, `draft_cache`); a draft's
        cache of its own prefills here."""
        d = self.decoder
        if d.draft is None or seq.config.mode == "ar":
            return
        if d.pooled:
            seq.draft_cache = d.draft_pool.row_cache(seq.row)
            d.draft_pool.commit(seq.row, 0)
        else:
            seq.draft_cache = d.draft.new_cache(d.positions_needed(seq))
            if fill:
                d.draft.forward(fill, seq.draft_cache)

    def draft_cache(self, seq):
        """The sequence's draft cache, holding a prefix of its committed text: a pool row (topped up from the target's
        KV by a draft that reads target rows), its own cache, or the oracle draft's copy of the target's text."""
        d = self.decoder
        if seq.draft_cache is None:  # the oracle draft: the target itself, over a cache of its own
            seq.draft_cache = d.target.new_cache(d.positions_needed(seq))
            d.target.forward(self.fill(seq), seq.draft_cache)
        elif d.draft_pool is not None and d.draft.capabilities.reads_target_rows:
            have, held = int(d.draft_pool.lengths[seq.row]), int(d.target_pool.lengths[seq.row])
            if held > have:
                d.draft_pool.copy_from(seq.row, d.target_pool, seq.row, held, start=have)
        return seq.draft_cache


class ArStep:
    """One target call for every row: each running sequence's last token, one new token each."""

    def __init__(self, decoder):
        self.decoder = decoder

    def run(self, running: list) -> None:
        if self.decoder.pooled:
            self._batched(running)
        else:
            for seq in running:
                with seq.alone():
                    self.one(seq)

    def one(self, seq) -> None:
        """One target-only step of one sequence over its own cache."""
        logits = self.decoder.target.forward([seq.last], seq.target_cache)
        self.commit(seq, logits[-1])

    def _batched(self, running: list) -> None:
        """One target call over the rows, or one per group of rows (runtime.batch.splits)."""
        d = self.decoder
        live = set(map(id, running))
        if d.row_split.sort_pays(self._lengths()):
            d.sort_rows()  # (not while a sequence prefills or drafts with the worker: it says so)
        order = d.rows.order
        tokens = np.array([[s.last if id(s) in live else 0] for s in order], dtype=np.int64)  # [A, 1]
        if self._splits(len(order)):
            self._two_cores(order, tokens, live)
            return
        wide = {"wide": True} if d.target.capabilities.wide else {}  # every core: the draft idles
        t0 = time.perf_counter()
        for first, rows in d.row_split.groups(self._lengths(), tuple(map(id, order))):
            if not any(id(s) in live for s in order[first:first + rows]):
                continue  # rows still prefilling only: their placeholder would be dropped anyway
            logits = d.target.forward_rows(tokens[first:first + rows], d.target_pool, first, **wide)  # [rows, 1, V]
            self._commit_rows(order[first:first + rows], first, logits, live)
        elapsed = time.perf_counter() - t0
        d.row_split.record(elapsed)
        if d.row_split.in_call:
            d.core_split.record(len(order), "wide", elapsed)

    def _splits(self, rows: int) -> bool:
        """Whether this step runs as two calls at once, one per core: able, and measured faster."""
        d = self.decoder
        able = d.row_split.in_call and d.target.capabilities.two_calls and d.mirror.cpus and rows >= 2
        return bool(able) and d.core_split.way(rows) == "split"

    def _two_cores(self, order: list, tokens: np.ndarray, live: set) -> None:
        d = self.decoder
        t0 = time.perf_counter()
        cut = balanced_cut(self._lengths())
        logits = d.target.forward_rows_split(tokens, d.target_pool, cut, d.mirror.cpus)  # [A, 1, V]
        d.core_split.record(len(order), "split", time.perf_counter() - t0)
        self._commit_rows(order, 0, logits, live)

    def _commit_rows(self, rows: list, first: int, logits, live: set) -> None:
        """Each live sequence of `rows` (rows first.. of the pool) takes its token from `logits` [rows, 1, V]."""
        for row, seq in enumerate(rows, start=first):
            if id(seq) in live:
                self.decoder.target_pool.commit(row, seq.length)  # the last token is in: all but the next one
                with seq.alone():
                    self.commit(seq, logits[row - first, -1])

    def _lengths(self) -> list[int]:
        """Positions each row attends to in a one-token call (its committed ones and the new token)."""
        pool = self.decoder.target_pool
        return [int(pool.lengths[row]) + 1 for row in range(len(self.decoder.rows))]

    @staticmethod
    def commit(seq, row_logits) -> None:
        token = choose_under(seq.rules, row_logits, seq.config.sampling, seq.config.seed, seq.length)
        seq.metrics.record_step(0, 0)
        seq.commit([token], 0, 0)
