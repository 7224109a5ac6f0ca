"""Mirror-SD in the batched decoder: the target verifies each sequence's window while the draft precomputes.

The decoder's thread is the target worker: it verifies the running sequences one after another, each through
its `mirror.TargetRow` (prefix, early exit sent at once, suffix, verdict); one `DraftWorker` thread drafts for
all of them on its own core, so while the target verifies one sequence the draft prepares the next windows of
the others (runtime.mirror.draft_worker). A sequence joins the worker at its first Mirror step, from its committed text
and its draft row; it leaves when it finishes, when the batch turns to target-only steps (its draft row is
rolled back to committed text, and it joins again, catching up in one forward, when speculation resumes), or
when its draft fails (it then goes on target-only, nothing lost). Sequences in sd or ar mode step as SdStep
steps them. Rows of the draft pool that a joined sequence holds belong to the draft thread: their moves go
through it.
"""

from __future__ import annotations

from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.batch.steps import adopt_missed, alone
from mirror_rt.runtime.mirror.draft_worker import DraftStats, DraftWorker, Grow, Join, Leave, Move
from mirror_rt.runtime.mirror.target_row import DraftLink, TargetRow, draft_rules


class MirrorStep:
    """Mirror steps of the decoder's sequences, and the draft worker they share."""

    def __init__(self, decoder, cpus: tuple[int, int] | None = None):
        self.decoder = decoder
        self.cpus = cpus  # (target core, draft core) when each worker has one core of its own
        self.worker: DraftWorker | None = None

    def run(self, running: list, gamma: int) -> None:
        """One step of each running sequence: Mirror for mirror sequences, as SdStep for the others."""
        previous = pin(self.cpus[0]) if self.cpus else None
        threads = self._set_threads(1 if self.cpus else None)
        try:
            for seq in running:
                k = min(gamma, seq.config.gamma, seq.remaining - 1)
                if seq.config.mode == "mirror" and k >= 1 and self.splits():
                    with alone(seq):
                        self._step(seq, k)
                else:
                    self.decoder.sd.run([seq], gamma)
        finally:
            self._set_threads(threads)
            restore(previous)

    def splits(self) -> bool:
        """Whether the target runs split at its early exit (else mirror sequences run sd)."""
        return hasattr(self.decoder.target, "forward_prefix")

    def _step(self, seq, k: int) -> None:
        row = self._row(seq)
        if row.alive:
            tokens = row.run(seq.last, seq.length, k)
            drafted = row.counters["last_window"]
        else:  # its draft failed: target-only from here (the event is in its stats)
            tokens, drafted = row.alone(seq.last), 0
        seq.commit(tokens, drafted, len(tokens) - 1)

    def _row(self, seq) -> TargetRow:
        """The sequence's target row, joining it to the draft worker at its first Mirror step."""
        row = seq.state_data.get("mirror")
        if row is None:
            worker = self._worker()
            adopt_missed(self.decoder, seq)  # (before the row is the draft thread's)
            link = DraftLink(worker, seq.id, seq.config.draft_timeout_s)
            row = TargetRow(self.decoder.target, seq.config, seq.metrics, link, cache=seq.state_data["target_cache"],
                            rules=seq.rules)
            worker.join(seq.id, Join(self._draft_cache(seq), seq.prompt + seq.tokens, seq.config,
                                     rules=draft_rules(seq.rules)))
            seq.state_data["mirror"] = row
        return row

    def _draft_cache(self, seq):
        """The sequence's draft cache (its pool row, or the draft's own cache), from now on the draft thread's."""
        cache = seq.state_data.get("draft_cache")
        if cache is None:  # the oracle draft: the target itself drafts, from its own copy of the prompt
            d = self.decoder
            draft = d.draft or d.target
            cache = draft.new_cache(d.capacity)
            draft.forward(seq.prompt + seq.tokens[:-1], cache)
            seq.state_data["draft_cache"] = cache
        return cache

    def _worker(self) -> DraftWorker:
        if self.worker is None or not self.worker.thread.is_alive():
            draft = self.decoder.draft or self.decoder.target
            self.worker = DraftWorker(draft, cpu=self.cpus[1] if self.cpus else None)
            self.worker.start()
        return self.worker

    def _set_threads(self, threads: int | None) -> int | None:
        """The target's thread budget for this step (torch's is process-wide); returns the previous one."""
        target = self.decoder.target
        if threads is None or not hasattr(target, "set_threads"):
            return None
        return target.set_threads(threads)

    # --- rows joining and leaving ------------------------------------------------------

    def drafting(self) -> bool:
        """Whether the draft worker holds any sequence now (its core is then busy: prompts take one core)."""
        return self.worker is not None and bool(self.worker.outboxes)

    def joined(self, seq) -> bool:
        return "mirror" in seq.state_data

    def leave(self, seq) -> None:
        """The sequence stops speculating with the worker (finished, or the batch turns target-only)."""
        row = seq.state_data.pop("mirror", None)
        if row is not None:
            stats = None
            if self.worker is not None:  # else stopped already, and the draft row with it
                self.worker.call(seq.id, Leave(), seq.config.draft_timeout_s)
                stats = self.worker.finished.pop(seq.id, None)
            seq.state_data.setdefault("mirror_parts", []).append((stats or DraftStats(), row.counters))

    def move(self, seq, pool, dest: int) -> bool:
        """Move a joined sequence's draft row through the worker (in order with its work); False if not joined."""
        if not self.joined(seq) or self.worker is None:
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
