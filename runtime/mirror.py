"""Mirror-SD: the target verifies one window while the draft precomputes the next.

The target worker runs in the caller's thread (so Ctrl-C lands here) and the draft worker
(`draft_worker.DraftWorker`) in its own thread; they meet only through bounded queues of
small messages (`messages`). One step, target side:
  1. take the next window from the draft (the rendezvous);
  2. prefix layers over [last] + window; send the early-exit top-kappa to the draft at once;
  3. suffix layers; accept; send the verdict; roll the cache back; yield the committed tokens.
If the draft faults, stalls past `draft_timeout_s` or sends a malformed window, decoding
continues target-only from the committed text: no token is lost or duplicated.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from mirror_rt.runtime.acceptance import accept_greedy, accept_sampled
from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.draft_worker import DraftSettings, DraftWorker
from mirror_rt.runtime.messages import EarlyExit, Fault, Start, Window
from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.mirror_stats import mirror_summary
from mirror_rt.runtime.reference import adopts_target_kv, choose_under, prefill_logits, token_budget
from mirror_rt.runtime.sampling import SamplingConfig, keyed_rng, probabilities
from mirror_rt.runtime.token_rules import TokenRules, settle, verify_rows


@dataclass(frozen=True)
class MirrorSettings:
    """Knobs of the Mirror orchestrator."""

    gamma: int = 4  # maximum window
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    branch_budget: int | None = None  # side branches per step; None = auto (as many as fit)
    min_window: int = 1  # the draft sends a precomputed window once it has this many tokens
    adaptive_gamma: bool = True  # the draft adapts its window cap in 1..gamma from acceptance
    early_exit: str = "auto"  # on | off | auto: off while the draft is the bottleneck (no time for branches)
    draft_timeout_s: float = 10.0  # a draft silent this long is declared dead
    target_cpu: int | None = None  # pin the target (caller) thread to this core
    draft_cpu: int | None = None  # pin the draft thread to this core
    lookup: int = 3  # greedy: prompt-lookup guesses the draft checks per forward (runtime.lookup); 0 = off
    stream_confidence: float = 0.2  # SS drafts: a stream guess is fed only at this probability or more
    share_prompt_kv: bool = True  # a draft that is the target at another precision starts from its prompt KV

    def __post_init__(self):
        if self.early_exit not in ("on", "off", "auto"):
            raise ValueError(f"--early-exit must be on, off or auto, got {self.early_exit!r}")


class DraftFailure(Exception):
    """The draft worker is unusable; carries the reason for the stats."""


def mirror_generate(target, draft, prompt: Sequence[int], max_new_tokens: int, settings: MirrorSettings,
                    metrics: Metrics | None = None, rules: TokenRules | None = None) -> Iterator[list[int]]:
    """Yield the tokens committed at each step. `target` must offer forward_prefix/forward_suffix.

    `rules` (grammar, bias, penalties, logprobs) process the target's rows; the draft worker keeps a fork.
    """
    metrics = metrics or Metrics()
    budget = token_budget(len(prompt), max_new_tokens, target.max_seq_len)
    if budget == 0:
        return
    prompt = list(prompt)
    # headroom beyond the committed text: the window in flight, the bonus guess, the next window, SS guesses
    draft_capacity = len(prompt) + budget + 2 * settings.gamma + 16
    worker = DraftWorker(draft, prompt, draft_capacity, DraftSettings(
        gamma=settings.gamma, sampling=settings.sampling, seed=settings.seed, branch_budget=settings.branch_budget,
        min_window=settings.min_window, adaptive_gamma=settings.adaptive_gamma, cpu=settings.draft_cpu,
        lookup=settings.lookup, stream_confidence=settings.stream_confidence),
        rules.fork() if rules is not None and rules.changes_logits else None)
    step = _TargetStep(target, settings, metrics, worker, rules)
    share = settings.share_prompt_kv and adopts_target_kv(draft)
    previous_affinity = pin(settings.target_cpu)
    previous_threads = _set_threads(target, 1 if settings.target_cpu is not None else None)
    try:
        if share:  # the target prefills on both cores, then the draft starts from its KV
            last = step.prefill(prompt, len(prompt) + budget, helper_cpu=settings.draft_cpu, share=True)
            worker.cache = draft.adopt(step.cache, draft_capacity)
            worker.start()
        else:  # both prefill at once, each on its own core
            worker.start()
            last = step.prefill(prompt, len(prompt) + budget)
        yield [last]
        produced, length = 1, len(prompt) + 1
        worker.inbox.put(Start(last), timeout=settings.draft_timeout_s)
        while produced < budget:
            k_max = min(settings.gamma, budget - produced - 1)
            tokens = step.run(last, length, k_max) if step.alive else step.alone(last)
            produced += len(tokens)
            length += len(tokens)
            last = tokens[-1]
            yield tokens
    finally:
        worker.stop()
        restore(previous_affinity)
        _set_threads(target, previous_threads)
        metrics.extra = mirror_summary(metrics, worker.stats, step.counters)
        metrics.durations["draft_forward"] = [end - start for start, end in worker.stats.busy]


class _TargetStep:
    """The target worker's state: its cache, generator, counters and the draft link."""

    def __init__(self, target, settings: MirrorSettings, metrics: Metrics, worker: DraftWorker,
                 rules: TokenRules | None = None):
        self.target, self.settings, self.metrics, self.worker = target, settings, metrics, worker
        self.rules = rules  # the sequence's token rules, at the committed text between steps
        self.cache = None
        self.suffix_s = 0.0  # running mean of the suffix time (tells the draft when to expect the verdict)
        self.wait_s = 0.0  # running mean of the rendezvous wait (the draft is the bottleneck when large)
        self.alive = True
        # a target that computes while the host goes on (CUDA) queues its suffix before reading its exit back
        self.ahead = getattr(target, "asynchronous", False) and hasattr(target, "launch_prefix")
        self.counters = {"exit_covered": 0, "corrections": 0, "busy": [], "fallback_steps": 0, "exit_steps": 0}

    def prefill(self, prompt: list[int], capacity: int, helper_cpu: int | None = None, share: bool = False) -> int:
        """The prompt; pipelined over this core and `helper_cpu` when the backend can and the draft is idle."""
        self.cache = self.target.new_cache(capacity)
        with self.metrics.stage("target_prefill"):
            if share and hasattr(self.target, "prefill_pipelined"):
                logits = self.target.prefill_pipelined(prompt, self.cache, helper_cpu)[-1]
            else:
                logits = prefill_logits(self.target, prompt, self.cache)
        return choose_under(self.rules, logits, self.settings.sampling, self._rng(len(prompt)))

    def run(self, last: int, length: int, k_max: int) -> list[int]:
        """One Mirror step; on any draft failure, fall back and do a target-only step."""
        try:
            window = self._take_window(length, k_max)
        except DraftFailure as failure:
            self._fall_back(str(failure))
            return self.alone(last)
        tokens = list(window.tokens[:k_max])
        base = self.cache.length
        # Phase 2: prefix and early exit, sent to the draft at once (a device target queues its
        # suffix first, so it computes while the exit's few ids travel back)
        t0 = time.perf_counter()
        with self.metrics.stage("target_prefix"):
            exit_rows = self._prefix([last] + tokens)
            queued = self.target.forward_suffix(self.cache) if self.ahead else None  # [k+1, vocab] on the device
            ids, logprobs = exit_rows.result() if self.ahead else exit_rows
        self._send(EarlyExit(length, tuple(tokens), ids, logprobs, self.suffix_s))
        # Phase 3: suffix and verification
        t1 = time.perf_counter()
        with self.metrics.stage("target_suffix"):
            logits = self.target.forward_suffix(self.cache) if queued is None else queued  # [k+1, vocab]
            rows, tokens, advanced = verify_rows(self.rules, logits, tokens)  # processed by the rules
            verdict = self._accept(tokens, window, rows, length)
        suffix_s = time.perf_counter() - t1
        self.suffix_s = 0.8 * self.suffix_s + 0.2 * suffix_s if self.suffix_s else suffix_s
        self.counters["busy"].append((t0, time.perf_counter()))
        if tokens:  # a verification of draft tokens (a window of 0 is a plain target step)
            self.metrics.durations.setdefault("target_verify", []).append(time.perf_counter() - t0)
        # Phase 4: commit, tell the draft, roll back the rejected positions
        self.cache.rollback(base + 1 + verdict.num_accepted)
        settle(self.rules, advanced, tokens, verdict, logits)  # the rules roll back with the cache
        self._send(verdict)
        self._count_exit(tokens, verdict, ids)
        self.metrics.record_step(len(tokens), verdict.num_accepted)
        return tokens[:verdict.num_accepted] + [verdict.next_token]

    def _prefix(self, tokens: list[int]):
        """The prefix layers, with the early-exit candidates when they can pay off ([T, 0] when not)."""
        use = self.settings.early_exit == "on" or (
            self.settings.early_exit == "auto" and self.wait_s <= 0.25 * self.suffix_s)
        if use or not hasattr(self.target, "forward_prefix_only"):
            self.counters["exit_steps"] += 1
            if self.ahead:
                return self.target.launch_prefix(tokens, self.cache)  # a pending read (result() later)
            return self.target.forward_prefix(tokens, self.cache)
        self.target.forward_prefix_only(tokens, self.cache)
        empty = np.zeros((len(tokens), 0))
        return _Ready(empty.astype(np.int64), empty) if self.ahead else (empty.astype(np.int64), empty)

    def alone(self, last: int) -> list[int]:
        """A target-only step (after a draft failure)."""
        with self.metrics.stage("target_alone"):
            logits = self.target.forward([last], self.cache)
        self.metrics.record_step(0, 0)
        self.counters["fallback_steps"] += 1
        return [choose_under(self.rules, logits[-1], self.settings.sampling, self._rng(self.cache.length))]

    def _rng(self, position: int) -> np.random.Generator:
        """The target's draws for the token(s) from `position` on (runtime.sampling.keyed_rng, stream 2)."""
        return keyed_rng(self.settings.seed, 2, position)

    def _take_window(self, length: int, k_max: int) -> Window:
        # Phase 1: the rendezvous; the window must continue exactly the committed text
        t0 = time.perf_counter()
        with self.metrics.stage("target_wait"):
            try:
                message = self.worker.outbox.get(timeout=self.settings.draft_timeout_s)
            except queue.Empty:
                raise DraftFailure(f"draft stalled for more than {self.settings.draft_timeout_s:g} s") from None
        self.wait_s = 0.8 * self.wait_s + 0.2 * (time.perf_counter() - t0)
        if isinstance(message, Fault):
            raise DraftFailure(f"draft failed: {message.reason}")
        _check_window(message, length, self.settings, self.target.vocab_size)
        return message

    def _accept(self, tokens, window: Window, logits, length):
        if self.settings.sampling.greedy:
            return accept_greedy(tokens, logits, length)
        p = probabilities(logits, self.settings.sampling)
        return accept_sampled(tokens, window.q[:len(tokens)], p, self._rng(length), length)

    def _send(self, message) -> None:
        if not self.alive:
            return
        try:
            self.worker.inbox.put(message, timeout=self.settings.draft_timeout_s)
        except queue.Full:
            self._fall_back("draft inbox full (draft not reading)")

    def _count_exit(self, tokens, verdict, ids) -> None:
        if verdict.num_accepted < len(tokens) and ids.shape[1]:
            self.counters["corrections"] += 1
            self.counters["exit_covered"] += int(verdict.next_token in ids[verdict.num_accepted])

    def _fall_back(self, reason: str) -> None:
        if self.alive:
            self.alive = False
            self.metrics.events.append(f"fallback to target-only: {reason}")
            self.worker.stop(timeout=0.05)


class _Ready:
    """Early-exit rows already on the host, read like a pending read (`result()`)."""

    def __init__(self, ids: np.ndarray, logprobs: np.ndarray):
        self.rows = (ids, logprobs)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.rows


def _set_threads(model, threads: int | None) -> int | None:
    """Apply a thread budget where the backend supports one; returns the previous value."""
    if threads is None or not hasattr(model, "set_threads"):
        return None
    return model.set_threads(threads)


def _check_window(window, length: int, settings: MirrorSettings, vocab_size: int) -> None:
    """Refuse a window that does not continue the committed text or is malformed."""
    if not isinstance(window, Window):
        raise DraftFailure(f"draft sent {type(window).__name__}, expected a window")
    if window.base_length != length:
        raise DraftFailure(f"draft window continues length {window.base_length}, committed is {length}")
    k = len(window.tokens)
    if not 1 <= k <= settings.gamma:
        raise DraftFailure(f"draft window has {k} tokens, expected 1..{settings.gamma}")
    if any(not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size) for t in window.tokens):
        raise DraftFailure("draft window has token ids outside the vocabulary")
    if not settings.sampling.greedy and (window.q is None or window.q.shape != (k, vocab_size)):
        raise DraftFailure("draft window lacks its q rows [k, vocab] under sampling")
