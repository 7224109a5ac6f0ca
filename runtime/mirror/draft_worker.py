"""The Mirror-SD draft worker: one thread that drafts for every sequence of a batch while the target verifies.

Each sequence is a `DraftRow` (runtime.mirror.draft_row) keyed by the caller's key; the target side talks to it only
through this worker: `send(key, message)` puts (key, message) in the one inbox, and the row's windows come out
of its own outbox (`outbox(key)`). Between messages the thread spends one draft forward at a time on the row
that needs it most: a main line shorter than its next window first (rows in the target's verification order,
starting after the row just verified), then side branches of the row whose verdict is due soonest, within the
time before that verdict (the branch budget is the draft's time, shared by the batch). `join` adds a row
(its cache already prefilled, or prefilled here from `prompt` while the target prefills), `leave` drops it,
`move` rebinds a row's cache after its sequence moved to another pool row (the pool copy happens here, in
order with the row's work). A failure sends `Fault` to every row's outbox: the target side never hangs on it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from mirror_rt.runtime.affinity import pin
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.mirror.draft_row import DraftConfig, DraftRow, DraftStats, Line  # noqa: F401 (re-exported)
from mirror_rt.runtime.mirror.messages import STOP, Fault, Start, Verdict
from mirror_rt.runtime.reference import prefill_logits


@dataclass(frozen=True)
class Join:
    """A sequence joins: its draft cache, its committed text (prompt + first token), or its prompt only (the
    first token follows as `Start`, the cache is prefilled here when `prefill`), and its request's settings."""

    cache: object
    committed: list[int]
    config: GenerationConfig
    settings: DraftConfig = DraftConfig()
    waits_for_start: bool = False
    prefill: bool = False
    rules: object = None  # runtime.token_rules.TokenRules at `committed`, the row's own (None: no rules)


@dataclass(frozen=True)
class Leave:
    """A sequence stops drafting: its cache is rolled back to committed text (a prefix of it) and its row dropped."""

    done: threading.Event = field(default_factory=threading.Event)  # set once handled


@dataclass(frozen=True)
class Move:
    """The sequence's pool row moves: copy it in `pool` (from its cache's row to `row`) and rebind its cache."""

    pool: object
    row: int
    done: threading.Event = field(default_factory=threading.Event)  # set once handled


@dataclass(frozen=True)
class Grow:
    """A pool the worker reads needs room for `positions` per row (new buffers: not while a forward runs)."""

    pool: object
    positions: int
    done: threading.Event = field(default_factory=threading.Event)  # set once handled


class DraftWorker:
    """Runs in its own thread; rows join and leave at any time."""

    def __init__(self, draft, cpu: int | None = None):
        self.draft, self.cpu = draft, cpu
        self.inbox: queue.Queue = queue.Queue()
        self.rows: dict = {}  # key -> DraftRow (the thread's own)
        self.outboxes: dict = {}  # key -> queue.Queue of windows / faults (made by the caller's thread)
        self.finished: dict = {}  # key -> DraftStats of rows that left (for the caller's stats)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mirror-draft", daemon=True)
        self.last_verdict = None  # key of the row that got the latest verdict (the next one is verified next)

    # --- the target's side (any thread) ---------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it (a forward in progress finishes first)."""
        self.stop_event.set()
        self.inbox.put((None, STOP))
        self.thread.join(timeout)

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stop_event.is_set()

    def join(self, key, message: Join) -> queue.Queue:
        """Add a row; returns its outbox."""
        self.outboxes[key] = outbox = queue.Queue(maxsize=2)
        self.inbox.put((key, message))
        return outbox

    def send(self, key, message) -> None:
        self.inbox.put((key, message))

    def call(self, key, message, timeout: float = 10.0) -> None:
        """Send a Leave or Move and wait until the thread has handled it (rows are then free to reuse)."""
        self.inbox.put((key, message))
        if self.thread.is_alive():
            message.done.wait(timeout)

    def outbox(self, key) -> queue.Queue:
        return self.outboxes[key]

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if pin(self.cpu) is not None and hasattr(self.draft, "set_threads"):
                self.draft.set_threads(1)  # one core each: the two workers must not contend
            while not self.stop_event.is_set():
                item = self._poll()
                if item is not None:
                    self._handle(*item)
                elif not self._speculate_one():
                    self._handle(*self._get())
        except Exception as exc:  # noqa: BLE001 -- the target must hear of any failure, never hang on it
            for key in list(self.outboxes):
                self._put(key, Fault(f"{type(exc).__name__}: {exc}"))

    def _poll(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _get(self):
        while not self.stop_event.is_set():
            try:
                return self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
        return None, STOP

    def _put(self, key, message) -> None:
        outbox = self.outboxes.get(key)
        while outbox is not None and not self.stop_event.is_set():
            try:
                outbox.put(message, timeout=0.1)
                return
            except queue.Full:
                continue

    def _handle(self, key, message) -> None:
        if message is STOP:
            self.stop_event.set()
        elif isinstance(message, Join):
            self._join(key, message)
        elif isinstance(message, Leave):
            self._leave(key)
            message.done.set()
        elif isinstance(message, Grow):
            message.pool.grow(message.positions)
            message.done.set()
        elif isinstance(message, Move):
            row = self.rows.get(key)
            if row is not None:
                message.pool.move(row.cache.row, message.row)
                row.cache.row = message.row
            message.done.set()
        elif key in self.rows:
            self._route(key, message)

    def _route(self, key, message) -> None:
        row = self.rows[key]
        if isinstance(message, Start):
            row.commit([message.first_token])
            row.line, row.waiting = Line(rules=row.fork_rules()), False  # nothing was drafted before it
            row.send_window(reused=False)
            return
        row.handle(message)
        if isinstance(message, Verdict):
            self.last_verdict = key

    def _leave(self, key) -> None:
        """Drop a row; its cache keeps only a prefix of the committed text (nothing speculative)."""
        row = self.rows.pop(key, None)
        self.outboxes.pop(key, None)
        if row is None:
            return
        same = 0
        for a, b in zip(row.cache_tokens, row.committed):
            if a != b:
                break
            same += 1
        if same < row.cache.length:
            row.cache.rollback(same)
        self.finished[key] = row.stats

    def _join(self, key, message: Join) -> None:
        cache = message.cache
        prompt = message.committed if message.waits_for_start else message.committed[:-1]
        if message.prefill:
            prefill_logits(self.draft, prompt, cache)  # overlaps the target's prefill
        row = DraftRow(self.draft, cache, message.committed, message.config, message.settings,
                       send=lambda m, key=key: self._put(key, m), rules=message.rules)
        row.cache_tokens = list(prompt[:cache.length])
        row.waiting = message.waits_for_start  # no speculation before the first token is known
        self.rows[key] = row
        if not row.waiting:
            row.send_window(reused=False)

    def _speculate_one(self) -> bool:
        """One forward for the row that needs it most; False when no row has work worth doing."""
        rows = [r for r in self._verification_order() if not r.waiting]
        for row in rows:  # main lines first: a short line delays that row's next window
            if row.line_short():
                row.timed(row.extend_line)
                return True
        for row in sorted(rows, key=lambda r: r.verdict_due or float("inf")):
            if row.timed(row.grow_branch):
                return True
        return False

    def _verification_order(self) -> list[DraftRow]:
        """Rows in the order the target verifies them next: the one after the latest verdict first."""
        keys = list(self.rows)
        if self.last_verdict in self.rows:
            i = keys.index(self.last_verdict) + 1
            keys = keys[i:] + keys[:i]
        return [self.rows[k] for k in keys]


def summed(stats: list[DraftStats]) -> DraftStats:
    """Draft statistics of several rows added up (busy intervals merged in time order)."""
    total = DraftStats()
    for s in stats:
        for name in ("windows", "main_hits", "side_hits", "misses", "not_ready", "branches_rolled", "forwards",
                     "rollbacks", "guessed", "guesses_kept", "forced", "rollout_s", "fresh_s"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        total.busy.extend(s.busy)
    total.busy.sort()
    return total
