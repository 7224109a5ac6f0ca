"""The batched decoder: many sequences decoded together, joining and leaving at step boundaries.

Every token is the target's own choice at its position (runtime.sampling.choose_at), so a sequence's text does
not depend on its companions, its mode or its windows. Not thread-safe except `add` (and `Sequence.cancel`):
one thread calls `step`.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from mirror_rt.runtime.batch.kv_rows import BLOCK_SIZE, BlockBudget, RowMap, blocks_for
from mirror_rt.runtime.batch.policy import AR, SPREAD, SpeculationPolicy
from mirror_rt.runtime.batch.prefix_cache import PrefixCache
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.batch.splits import CoreSplit, RowSplit
from mirror_rt.runtime.batch.steps import ArStep, Prefill
from mirror_rt.runtime.mirror.step import MirrorStep
from mirror_rt.runtime.values import is_integer, is_number

WINDOW_ROOM = 80  # positions past the committed text a step may write (window, padding, draft guesses)
DEFAULT_KV_GB = 4.0  # the KV budget without --kv-cache-gb, in GiB (less where every row at full length takes less)


@dataclass(frozen=True)
class BatchConfig:
    """How many sequences an engine decodes at once and with how much KV memory."""

    max_num_seqs: int = 16  # sequences holding a row at once (running or prefilling)
    # KV memory of both models' rows and the prefix cache; None: DEFAULT_KV_GB, or every row at full length if less
    kv_cache_gb: float | None = None
    prefill_chunk: int = 256  # prompt positions per step (short prompts share it): prompts stall the others briefly
    prefix_cache: bool = True  # keep full blocks of finished requests for the next ones that share them
    prefix_cache_share: float = 0.5  # of the KV budget, the most the prefix cache keeps (it gives way to requests)
    adaptive_speculation: bool = True  # speculate only while it pays at this load (batch.policy); False: as asked

    def __post_init__(self):
        if not (is_integer(self.max_num_seqs) and self.max_num_seqs >= 1):
            raise ValueError(f"--max-num-seqs must be a whole number >= 1, got {self.max_num_seqs!r}")
        if self.kv_cache_gb is not None and not (is_number(self.kv_cache_gb) and self.kv_cache_gb > 0):
            raise ValueError(f"--kv-cache-gb must be a number > 0, got {self.kv_cache_gb!r}")
        if not (is_number(self.prefix_cache_share) and 0 < self.prefix_cache_share <= 1):
            raise ValueError(f"--prefix-cache-share must be a number in (0, 1], got {self.prefix_cache_share!r}")
        if not (is_integer(self.prefill_chunk) and self.prefill_chunk >= 1):
            raise ValueError(f"--prefill-chunk must be a whole number >= 1, got {self.prefill_chunk!r}")
        for name, value in (("prefix_cache", self.prefix_cache), ("adaptive_speculation", self.adaptive_speculation)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")


class KVTooLarge(ValueError):
    """A request that can never fit in the KV memory (one line, naming the numbers)."""


class BatchDecoder:
    """Sequences, their rows and caches, and the step loop over them."""

    def __init__(self, target, draft=None, settings: BatchConfig = BatchConfig(), policy=None,
                 cpus: tuple[int, int] | None = None):
        self.target, self.draft, self.settings = target, draft, settings
        self.pooled = target.capabilities.rows and (draft is None or draft.capabilities.rows)
        self.capacity = target.max_seq_len + WINDOW_ROOM
        rows = settings.max_num_seqs
        self.target_pool = target.new_pool(rows, self.capacity) if self.pooled else None
        self.draft_pool = draft.new_pool(rows, self.capacity) if self.pooled and draft is not None else None
        self.rows = RowMap(rows)
        self.budget = BlockBudget(self._total_blocks())
        self.cache = None
        if self.pooled and settings.prefix_cache:  # only the target's KV is kept (runtime.batch.prefix_cache)
            self.cache = PrefixCache(max(1, int(settings.prefix_cache_share * self.budget.total)),
                                     block_bytes=self.target_pool.bytes_per_position * BLOCK_SIZE)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []  # holding a row: prefill, then running
        self.lock = threading.Lock()
        self.policy = policy or SpeculationPolicy(adaptive=settings.adaptive_speculation)
        self.gamma = 0  # gamma of the latest step (0: target-only), the server's gauge
        self.prefill, self.ar = Prefill(self), ArStep(self)
        self.mirror = MirrorStep(self, cpus)
        # target-only steps: one call, or one per group of rows of like lengths (graphs that group rows inside
        # a call: always one call, rows never sorted)
        self.row_split = RowSplit(in_call=target.capabilities.attention_groups if self.pooled else 0)
        self.core_split = CoreSplit()  # such steps: one call on both cores, or two at once (runtime.batch.splits)
        self.steps = 0

    def describe(self) -> str:
        """How this decoder batches and the KV budget it keeps, for the server's start-up line."""
        s = self.settings
        if not self.pooled:
            return (f"up to {s.max_num_seqs} sequences side by side, one model call each (these graphs take one "
                    "sequence a call: no shared calls, no prefix cache)")
        rule = "--kv-cache-gb" if s.kv_cache_gb is not None else (
            f"default: {DEFAULT_KV_GB:g} GiB or every row at full length, the smaller")
        whole = blocks_for(self.capacity)
        short = (f"; one request at the model's full context needs {whole * BLOCK_SIZE} positions, "
                 f"{_size(self.budget_bytes() // self.budget.total * whole)}" if whole > self.budget.total else "")
        # a cached block counts as one block of the budget but holds the target's KV only
        cache = (f"prefix cache up to {self.cache.max_blocks} of those blocks ({s.prefix_cache_share:.0%}; the "
                 f"target's KV only: {_size(self.cache.max_blocks * self.cache.block_bytes)})"
                 if self.cache is not None else "prefix cache off")
        return (f"batches of up to {s.max_num_seqs} sequences, KV budget {_size(self.budget_bytes())} "
                f"({self.budget.total} blocks of {BLOCK_SIZE} positions, both models' KV; {rule}{short}), {cache}, "
                f"speculation {'adaptive' if s.adaptive_speculation else 'as requests ask'}")

    def budget_bytes(self) -> int:
        """The KV budget in bytes (both models' rows; 0 where caches are per sequence)."""
        per_position = sum(p.bytes_per_position for p in (self.target_pool, self.draft_pool) if p is not None)
        return self.budget.total * BLOCK_SIZE * per_position

    def kv_usage(self) -> float:
        """Share of the KV budget held now: blocks reserved by sequences plus the prefix cache's (vLLM's
        kv_cache_usage_perc, 0..1)."""
        cached = len(self.cache) if self.cache is not None else 0
        return min(1.0, (self.budget.reserved + cached) / self.budget.total) if self.budget.total else 0.0

    # --- other threads ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (KVTooLarge when it could never fit)."""
        need = self.blocks_needed(seq)
        if need > self.budget.total or len(seq.prompt) + 1 > self.capacity - WINDOW_ROOM:
            raise KVTooLarge(f"request needs {need * BLOCK_SIZE} KV positions but the KV cache holds "
                             f"{self.budget.total * BLOCK_SIZE} (raise --kv-cache-gb or lower max_tokens)")
        with self.lock:
            self.waiting.append(seq)

    # --- the stepping thread ------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting

    def step(self) -> bool:
        """One step of every sequence; returns whether work remains."""
        self._drop_cancelled_waiting()
        self._admit()
        prompts = any(s.state == "prefill" and not s.done for s in self.active)
        if self.policy.prompts_first(prompts):  # the draft worker leaves the other core to the prompts
            for seq in self.active:
                self.mirror.leave(seq)
        self.prefill.run()
        running = self._running()
        if running:
            self._decode(running, prompts)
            self.steps += 1
        self._release()
        if self.idle:  # nothing left to draft for: the draft thread ends (it starts again with the next request)
            self.mirror.close()
        return not self.idle

    def _running(self) -> list[Sequence]:
        return [s for s in self.active if s.state == "running" and not s.done and not s.cancel_event.is_set()]

    def _decode(self, running: list[Sequence], prompts: bool = False) -> None:
        """One decode step of every running sequence, the way the policy picks; its outcome goes back to the policy."""
        gamma = self.policy.gamma(self, running, prompts)
        last = {id(s) for s in running if s.remaining <= 1}  # no room for a window
        before = sum(len(s.tokens) for s in running)
        settled = all(s.metrics.steps for s in running)  # no sequence on its first window
        t0 = time.perf_counter()
        if gamma == 0:
            for seq in running:  # their draft rows wait, rolled back to committed text, until speculation resumes
                self.mirror.leave(seq)
            self.ar.run(running)
        else:
            self.mirror.run(running, gamma, spread=self.policy.last == SPREAD)
        way = AR if gamma == 0 else self.policy.last
        self.policy.record(way, len(running), sum(len(s.tokens) for s in running) - before, time.perf_counter() - t0,
                           settled)
        self.gamma = gamma
        for seq in running:
            if not (seq.metrics.window or (0, 0))[0]:
                why = self._target_only_reason(seq, gamma, id(seq) in last)
                seq.metrics.target_only[why] = seq.metrics.target_only.get(why, 0) + 1

    def _target_only_reason(self, seq: Sequence, gamma: int, last: bool) -> str:
        """Why `seq`'s step verified no draft token (a key of runtime.metrics.WHY_TARGET_ONLY)."""
        if seq.config.mode == "ar":
            return "asked"
        if gamma == 0:
            return self.policy.reason or "slower"
        if last:
            return "last_token"
        if any(event.startswith("fallback to target-only") for event in seq.metrics.events):
            return "draft_failed"
        return "empty_window"

    def close(self) -> None:
        """Stop the draft worker (started again when needed); speculating sequences leave it first."""
        for seq in self.active:
            self.mirror.leave(seq)
        self.mirror.close()

    # --- rows, blocks, prefix cache -------------------------------------------------------

    def positions_needed(self, seq: Sequence) -> int:
        """KV positions `seq` may hold: its prompt, its output budget and the window in flight (at most the context)."""
        return min(len(seq.prompt) + seq.budget, self.capacity - WINDOW_ROOM) + WINDOW_ROOM

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks `seq` reserves: everything it may hold (`positions_needed`)."""
        return blocks_for(self.positions_needed(seq))

    def _admit(self) -> None:
        while self.waiting and len(self.rows) < self.rows.rows:
            seq = self.waiting[0]
            if not self._reserve(seq):
                return  # waits for running sequences to finish (FIFO: nobody overtakes it)
            with self.lock:
                self.waiting.popleft()
            seq.row, seq.state, seq.admitted = self.rows.add(seq), "prefill", time.perf_counter()
            self._grow(seq)
            self.active.append(seq)
            self.prefill.start(seq)
            if self.cache is not None and len(self.cache) > self.budget.spare:  # its own blocks, now in its row
                self.cache.evict(len(self.cache) - self.budget.spare)

    def _grow(self, seq: Sequence) -> None:
        """Room in the pools for all `seq` may hold (buffers follow the longest request so far, not the context)."""
        if self.pooled:
            need = self.positions_needed(seq)
            self.target_pool.grow(need)
            if self.draft_pool is not None:
                self.mirror.grow(self.draft_pool, need)

    def _reserve(self, seq: Sequence) -> bool:
        """Reserve `seq`'s blocks, evicting cached blocks it does not reuse first (its own cached prefix is kept)."""
        need = self.blocks_needed(seq)
        cached = len(self.cache) if self.cache else 0
        if self.budget.reserve(seq, need, cached):
            return True
        if not self.cache:
            return False
        own = self.cache.held(self.prefill.cache_tokens(seq))
        self.cache.evict(need - self.budget.spare + cached, keep=own)
        return self.budget.reserve(seq, need, len(self.cache) - len(own))

    def _drop_cancelled_waiting(self) -> None:
        with self.lock:
            dropped = [s for s in self.waiting if s.cancel_event.is_set()]
            for seq in dropped:
                self.waiting.remove(seq)
        for seq in dropped:
            seq.finish("cancelled")
            seq.state = "done"

    def _release(self) -> None:
        for seq in [s for s in self.active if s.done or s.cancel_event.is_set()]:
            seq.finish("cancelled")  # no-op when it already finished
            self.mirror.leave(seq)
            self.active.remove(seq)
            self.budget.release(seq)  # first: its blocks are the room its prefix is kept in
            self._keep_prefix(seq)
            move = self.rows.remove(seq)
            if move is not None:
                self._move_row(*move)
            seq.row, seq.state = None, "done"

    def sort_rows(self) -> None:
        """Rows in order of length, by swaps of both models' rows; only while no sequence prefills or drafts."""
        if not self.pooled or any(s.state != "running" or s.mirror is not None for s in self.active):
            return
        for i in range(len(self.rows)):
            lengths = self.target_pool.lengths
            j = min(range(i, len(self.rows)), key=lambda row: (int(lengths[row]), row))
            if int(lengths[j]) < int(lengths[i]):
                self._swap_rows(i, j)
        self.row_split.sorts += 1

    def _swap_rows(self, a: int, b: int) -> None:
        for pool in (self.target_pool, self.draft_pool):
            if pool is not None:
                kept, length = pool.read(a, 0, int(pool.lengths[a])), int(pool.lengths[a])
                pool.move(b, a)
                pool.write(b, 0, kept)
                pool.commit(b, length)
        order = self.rows.order
        order[a], order[b] = order[b], order[a]
        self._rebind(order[a], a)
        self._rebind(order[b], b)

    def _move_row(self, source: int, dest: int) -> None:
        """The last row fills a freed one: every pool copies it, its sequence's caches follow."""
        moved = self.rows.order[dest]
        if self.pooled:  # (caches of their own per sequence: nothing to copy)
            self.target_pool.move(source, dest)
            if self.draft_pool is not None and not self.mirror.move(moved, self.draft_pool, dest):
                self.draft_pool.move(source, dest)
        self._rebind(moved, dest)  # (a joined draft cache was rebound by the worker already: the same row)

    def _keep_prefix(self, seq: Sequence) -> None:
        """Store the full blocks of a finished sequence's committed positions in the prefix cache."""
        if self.cache is None or seq.state == "waiting":
            return
        held = int(self.target_pool.lengths[seq.row])
        tokens = (seq.prompt + seq.tokens)[:held]
        self.cache.store(self.target_pool, seq.row, tokens, limit=self.budget.spare)

    def _rebind(self, seq: Sequence, row: int) -> None:
        """`seq` and its row caches now point at `row`."""
        seq.row = row
        if self.pooled:
            seq.target_cache.row = row
            if self.draft_pool is not None and seq.draft_cache is not None:
                seq.draft_cache.row = row

    def _total_blocks(self) -> int:
        """The KV budget in blocks: --kv-cache-gb, else DEFAULT_KV_GB or every row at full length, the smaller."""
        per_position = sum(p.bytes_per_position for p in (self.target_pool, self.draft_pool) if p is not None)
        full = blocks_for(self.settings.max_num_seqs * self.capacity)
        if not per_position:  # caches of their own per sequence: rows are the only limit
            return full
        if self.settings.kv_cache_gb is not None:
            return self._blocks_of(self.settings.kv_cache_gb, per_position)
        return min(full, self._blocks_of(DEFAULT_KV_GB, per_position))

    def _blocks_of(self, gb: float, per_position: int) -> int:
        """The blocks --kv-cache-gb holds; ValueError when not even the smallest request fits."""
        blocks = int(gb * 2**30 // (per_position * BLOCK_SIZE))
        smallest, whole = blocks_for(2 + WINDOW_ROOM), blocks_for(self.capacity)  # 1 prompt token + 1 generated
        if blocks < smallest:
            size = lambda n: f"{n * BLOCK_SIZE * per_position / 2**30:.4g} GiB"  # noqa: E731
            raise ValueError(f"--kv-cache-gb {gb:g} holds {blocks * BLOCK_SIZE} KV positions, fewer than the smallest "
                             f"request needs ({smallest * BLOCK_SIZE}): give at least {size(smallest)} "
                             f"({size(whole)} holds one request at full context)")
        return blocks


def _size(count: int) -> str:
    """Bytes as a start-up line says them, in binary units as --kv-cache-gb counts them (2**30 bytes a GiB):
    4.00 GiB, 21.0 MiB."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


