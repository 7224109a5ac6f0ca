"""A prompt on one core while the running sequences decode on the other.

When a prompt waits alone (two of like lengths prefill at once, one per core: runtime.batch_steps.Prefill) and
sequences are running, the plain step prefills the prompt's chunk on both cores (a thread per core: measured here
only 1.2-1.45x one thread's speed) and the running sequences wait for it. Here the chunk runs on the second core
(the target's one-thread sessions) while this thread, on the first core, decodes every running sequence target-only,
one step after another in one call each, until the chunk is in. Both cores work at one thread's full rate, and one
core decoding all the rows reads the weights once per step where the split step (two calls, one per core) reads them
twice. A prompt's first token comes a little later (its chunk has one core); the running sequences do not stop for
it.
Each row computes alike on any core and in any call (exporters.exact_kv), so the text is unchanged. It applies to a
split ONNX Runtime target that takes every row in one call, with two cores of the decoder's own, in steps that
decode target-only anyway (prompts go first under the adaptive policy, runtime.policy; or every running sequence
asked for `ar`) while the draft worker holds no sequence, and when the prompt's row comes after every running row
(the decoding call covers rows 0..n-1; the prompt's row is written by the other core alone).
"""

from __future__ import annotations

import time

import numpy as np

from mirror_rt.runtime.affinity import pin, restore


class OverlapStep:
    """One prompt chunk on the second core, decode steps of the running rows on the first until it is in."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.steps = 0  # decoder steps that overlapped a prompt with decoding
        self.decodes = 0  # decode steps run beside prompts

    def run(self, running: list) -> bool:
        """Overlap the oldest waiting prompt that can with decoding `running`; False (nothing done) where it cannot
        apply, and the decoder steps as usual."""
        d = self.decoder
        found = self._prompt(running)
        if found is None:
            return False
        seq, rows = found
        for other in running:  # (no-ops: prompts went first) their draft rows wait at the committed text
            d.mirror.leave(other)
        chunk = d.prefill.fill(seq)[seq.computed:seq.computed + d.settings.prefill_chunk]
        cpus = d.mirror.cpus
        future = d.target.prefill_beside(chunk, seq.state_data["target_cache"], cpus)
        previous = pin(cpus[0])
        try:
            while True:
                live = [s for s in running if not s.done and not s.cancel_event.is_set()]
                if live:
                    self._decode(d.rows.order[:rows], live)
                if not live or future.done():
                    break
        finally:
            restore(previous)
            logits, seconds = future.result()  # waited for even when decoding failed: both write into the pool
        seq.metrics.add_stage("target_prefill", seconds)
        d.prefill.advance(seq, chunk, logits)
        d.gamma = 0
        self.steps += 1
        return True

    def _prompt(self, running: list) -> tuple | None:
        """(the waiting prompt to prefill, rows the decoding call covers), or None where the overlap cannot apply."""
        d = self.decoder
        target_only = d.policy.prompts_first(True) or all(s.config.mode == "ar" for s in running)
        able = (d.pooled and d.mirror.cpus and d.row_split.in_call and hasattr(d.target, "prefill_beside")
                and running and target_only and not d.mirror.drafting())
        if not able:
            return None
        turn = d.prefill.in_turn()  # the prompt whose turn it is (oldest, short ones before a long one)
        seq = turn[0] if turn else None
        if seq is None or seq.computed >= len(d.prefill.fill(seq)) or seq.row <= max(s.row for s in running):
            return None  # (its row among the running ones: the plain step; a prompt never waits for a later one)
        if not all(s.state == "running" for s in d.rows.order[:seq.row]):
            return None
        return seq, seq.row

    def _decode(self, order: list, live: list) -> None:
        """One target-only step of rows 0..len(order)-1 in one call on this core; the live sequences commit."""
        d = self.decoder
        ids = set(map(id, live))
        tokens = np.array([[s.last if id(s) in ids else 0] for s in order], dtype=np.int64)
        t0 = time.perf_counter()
        logits = d.target.forward_rows(tokens, d.target_pool, 0)
        elapsed = time.perf_counter() - t0
        d.ar.commit_rows(order, 0, logits, ids)
        for seq in live:
            seq.metrics.durations.setdefault("batch_step", []).append(elapsed)
        self.decodes += 1
        d.steps += 1
