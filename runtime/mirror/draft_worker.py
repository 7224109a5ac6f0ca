"""The Mirror-SD draft worker: one thread that drafts for every sequence of a batch while the target verifies.

The target side talks to a row only through `send(key, message)` and the row's outbox (`take`). A failure sends
`Fault` to every row's outbox: the target side never hangs on it.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import queue
import threading
import time

from mirror_rt.runtime.affinity import placed
from mirror_rt.runtime.mirror.draft_batch import extend_lines, plain, wants
from mirror_rt.runtime.mirror.draft_row import DraftConfig, DraftRow
from mirror_rt.runtime.mirror.messages import STOP, Fault, Grow, Join, Leave, Move, Verdict


class DraftFailure(Exception):
    """The draft worker is unusable for a sequence; carries the reason for its events."""


class DraftWorker:
    """Runs in its own thread; rows join and leave at any time."""

    def __init__(self, draft, cpu: int | None, handle, take_verdict=None, pool=None):
        self.draft, self.cpu, self.handle = draft, cpu, handle  # handle(row, message): an early exit, a verdict
        # with the draft's pool: the verdicts of a batched step are taken together (take_verdict(row, verdict)), and
        # the rows' lines extended in shared draft calls (runtime.mirror.draft_batch)
        self.take_verdict, self.pool = take_verdict, pool
        self.inbox: queue.Queue = queue.Queue()
        self.rows: dict = {}  # key -> DraftRow (the thread's own)
        self.outboxes: dict = {}  # key -> queue.Queue of windows / faults (made by the caller's thread)
        self.finished: dict = {}  # key -> DraftStats of rows that left (for the caller's stats)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mirror-draft", daemon=True)
        self.last_verdict = None  # key of the row that got the latest verdict (the next one is verified next)
        self.thread.start()

    # --- the target's side (any thread) ---------------------------------------------------

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it (a forward in progress finishes first)."""
        self.stop_event.set()
        self.inbox.put((None, STOP))
        self.thread.join(timeout)

    def join(self, key, message: Join) -> None:
        """Add a row (its outbox is made here, before its first window can arrive)."""
        self.outboxes[key] = queue.Queue(maxsize=2)
        self.inbox.put((key, message))

    def send(self, key, message) -> None:
        self.inbox.put((key, message))

    def call(self, key, message, timeout: float = 10.0) -> None:
        """Send a Leave or Move and wait until the thread has handled it (rows are then free to reuse)."""
        self.inbox.put((key, message))
        if self.thread.is_alive():
            message.done.wait(timeout)

    def take(self, key, timeout: float):
        """The row's next message (a window or a fault); DraftFailure after `timeout` seconds of silence."""
        try:
            return self.outboxes[key].get(timeout=timeout)
        except (queue.Empty, KeyError):
            raise DraftFailure(f"draft stalled for more than {timeout:g} s") from None

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with placed(self.draft, self.cpu):  # one core each: the two workers must not contend
                while not self.stop_event.is_set():
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:  # nothing to handle: one forward of speculation, or wait for a message
                        item = None if self._speculate_one() else self._get()
                    if item is not None and self.pool is not None and isinstance(item[1], Verdict):
                        item = self._verdicts(item)
                    if item is not None:
                        self._handle(*item)
        except Exception as exc:  # noqa: BLE001 -- the target must hear of any failure, never hang on it
            for key in list(self.outboxes):
                self._put(key, Fault(f"{type(exc).__name__}: {exc}"))

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
        row = self.rows.get(key)
        if message is STOP:
            self.stop_event.set()
        elif isinstance(message, Join):
            self.rows[key] = row = DraftRow(self.draft, message.cache, message.committed, message.config,
                                            message.draft or DraftConfig(), lambda m: self._put(key, m), message.rules)
            row.send_window(reused=False)
        elif isinstance(message, Leave):  # its cache keeps only a prefix of the committed text
            self.outboxes.pop(key, None)
            if self.rows.pop(key, None) is not None:
                row.trim()
                self.finished[key] = row.stats
            message.done.set()
        elif isinstance(message, Grow):
            message.pool.grow(message.positions)
            message.done.set()
        elif isinstance(message, Move):
            if row is not None:
                message.pool.move(row.cache.row, message.row)
                row.cache.row = message.row
            message.done.set()
        elif row is not None:
            self.handle(row, message)
            self.last_verdict = key if isinstance(message, Verdict) else self.last_verdict

    def _verdicts(self, first):
        """A verdict and those queued right behind it (a batched step's), taken together; the windows they need
        drafted in shared calls, then sent. Returns the next message that is no verdict (None: none waiting)."""
        verdicts, item = [first], None
        while item is None:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item[1], Verdict):
                verdicts.append(item)
                item = None
        taken = []
        for key, verdict in verdicts:
            row = self.rows.get(key)
            if row is not None:
                self.take_verdict(row, verdict)
                taken.append((row, bool(row.line.tokens)))
                self.last_verdict = key
        t0 = time.perf_counter()
        drafting = [(row, window_need(row)) for row, _ in taken if plain(row, row.line, self.draft, self.pool)]
        while drafting:  # the windows' fresh tokens (a reuse needs none)
            drafting = [(row, k) for row, k in drafting if wants(row, row.line, row.committed, k)]
            if drafting:
                self._extend([row for row, _ in drafting])
        for row, reused in taken:
            row.stats.fresh_s += time.perf_counter() - t0
            row.send_window(reused=reused)
        return item

    def _extend(self, rows: list[DraftRow]) -> None:
        """One more token of each row's main line, in shared draft calls over the worker's own pool rows."""
        own = {row.cache.row for row in self.rows.values()}
        extend_lines(self.draft, self.pool, [(row, row.line, row.committed) for row in rows], own.__contains__)

    def _speculate_one(self) -> bool:
        """One forward for the row that needs it most (with a pool: every short main line in one shared call);
        False when no row has work worth doing."""
        rows = self._verification_order()
        if self.pool is not None:
            short = [row for row in rows if row.line_short() and plain(row, row.line, self.draft, self.pool)
                     and wants(row, row.line, row.committed, len(row.line.tokens) + 1)]
            if short:
                t0 = time.perf_counter()
                self._extend(short)
                for row in short:
                    row.stats.rollout_s += time.perf_counter() - t0
                return True
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


def window_need(row: DraftRow) -> int:
    """Tokens `row.send_window` drafts fresh when its line holds fewer (greedy: at least min_window; sampling: full
    windows, so their length never depends on timing)."""
    config = row.config
    return min(row.k_cap, max(1, config.min_window)) if config.sampling.greedy else row.k_cap
