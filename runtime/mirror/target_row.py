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
from dataclasses import dataclass, field

import numpy as np

from mirror_rt.runtime.affinity import pin, restore
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.mirror.draft_worker import DraftConfig, DraftStats, DraftWorker, Join, Leave
from mirror_rt.runtime.mirror.messages import EarlyExit, Fault, Start, Window
from mirror_rt.runtime.mirror.stats import mirror_summary
from mirror_rt.runtime.reference import adopts_target_kv, choose_under, prefill_logits, token_budget
from mirror_rt.runtime.token_rules import TokenRules
from mirror_rt.runtime.verifier import verify_window


@dataclass(frozen=True)
class MirrorSettings:
    """Runtime-internal knobs of the Mirror orchestrator; every user setting is the request's GenerationConfig."""

    target_cpu: int | None = None  # pin the target (caller) thread to this core
    draft: DraftConfig = field(default_factory=DraftConfig)  # the draft worker's knobs, its core included
    share_prompt_kv: bool = True  # a draft that is the target at another precision starts from its prompt KV


class DraftFailure(Exception):
    """The draft worker is unusable; carries the reason for the stats."""


def mirror_generate(target, draft, prompt: Sequence[int], config: GenerationConfig,
                    settings: MirrorSettings | None = None, metrics: Metrics | None = None,
                    rules: TokenRules | None = None) -> Iterator[list[int]]:
    """Yield the tokens committed at each step. `target` must offer forward_prefix/forward_suffix.

    `rules` (grammar, bias, penalties, logprobs) process the target's rows; the draft worker keeps a fork.
    """
    settings = settings or MirrorSettings()
    metrics = metrics or Metrics()
    budget = token_budget(len(prompt), config.max_new_tokens, target.max_seq_len)
    if budget == 0:
        return
    prompt = list(prompt)
    # headroom beyond the committed text: the window in flight, the bonus guess, the next window, SS guesses
    draft_capacity = len(prompt) + budget + 2 * config.gamma + 16
    worker = DraftWorker(draft, cpu=settings.draft.cpu)
    link = DraftLink(worker, 0, config.draft_timeout_s)
    step = TargetRow(target, config, metrics, link, rules=rules)
    share = settings.share_prompt_kv and adopts_target_kv(draft)
    previous_affinity = pin(settings.target_cpu)
    previous_threads = _set_threads(target, 1 if settings.target_cpu is not None else None)
    try:
        if share:  # the target prefills on both cores, then the draft starts from its KV
            last = step.prefill(prompt, len(prompt) + budget, helper_cpu=settings.draft.cpu, share=True)
            worker.start()
            worker.join(0, Join(draft.adopt(step.cache, draft_capacity), prompt + [last], config, settings.draft,
                                rules=draft_rules(rules)))
        else:  # both prefill at once, each on its own core
            worker.start()
            worker.join(0, Join(draft.new_cache(draft_capacity), prompt, config, settings.draft,
                                waits_for_start=True, prefill=True, rules=draft_rules(rules)))
            last = step.prefill(prompt, len(prompt) + budget)
            link.send(Start(last))
        yield [last]
        produced, length = 1, len(prompt) + 1
        while produced < budget:
            k_max = min(config.gamma, budget - produced - 1)
            tokens = step.run(last, length, k_max) if step.alive else step.alone(last)
            produced += len(tokens)
            length += len(tokens)
            last = tokens[-1]
            yield tokens
    finally:
        worker.stop()
        restore(previous_affinity)
        _set_threads(target, previous_threads)
        stats = worker.rows[0].stats if 0 in worker.rows else worker.finished.get(0, DraftStats())
        metrics.extra = mirror_summary(metrics, stats, step.counters)
        metrics.durations["draft_forward"] = [end - start for start, end in stats.busy]


def draft_rules(rules: TokenRules | None) -> TokenRules | None:
    """The draft's copy of a sequence's rules (None when they leave the logits as they are)."""
    return rules.fork() if rules is not None and rules.changes_logits else None


class DraftLink:
    """One sequence's end of the draft worker: messages to its row, windows from its outbox."""

    def __init__(self, worker: DraftWorker, key, timeout_s: float):
        self.worker, self.key, self.timeout_s = worker, key, timeout_s

    def send(self, message) -> None:
        self.worker.send(self.key, message)

    def take(self):
        """The row's next message (a window or a fault); DraftFailure after `timeout_s` of silence."""
        try:
            return self.worker.outbox(self.key).get(timeout=self.timeout_s)
        except (queue.Empty, KeyError):
            raise DraftFailure(f"draft stalled for more than {self.timeout_s:g} s") from None

    def close(self) -> None:
        """The sequence needs its row no more."""
        self.worker.send(self.key, Leave())


class TargetRow:
    """One sequence on the target side: its cache, counters and its link to the draft's row."""

    def __init__(self, target, config: GenerationConfig, metrics: Metrics, link: DraftLink, cache=None,
                 rules: TokenRules | None = None):
        self.target, self.config, self.metrics, self.link = target, config, metrics, link
        self.rules = rules  # the sequence's token rules, at the committed text between steps
        self.cache = cache  # None: `prefill` makes one
        self.suffix_s = 0.0  # running mean of the suffix time (tells the draft when to expect the verdict)
        self.wait_s = 0.0  # running mean of the rendezvous wait (the draft is the bottleneck when large)
        self.alive = True
        # a target that computes while the host goes on (CUDA) queues its suffix before reading its exit back
        self.ahead = getattr(target, "asynchronous", False) and hasattr(target, "launch_prefix")
        self.counters = {"exit_covered": 0, "corrections": 0, "busy": [], "fallback_steps": 0, "exit_steps": 0,
                         "last_window": 0}  # draft tokens verified by the latest step

    def prefill(self, prompt: list[int], capacity: int, helper_cpu: int | None = None, share: bool = False) -> int:
        """The prompt; pipelined over this core and `helper_cpu` when the backend can and the draft is idle."""
        self.cache = self.cache or self.target.new_cache(capacity)
        with self.metrics.stage("target_prefill"):
            if share and hasattr(self.target, "prefill_pipelined"):
                logits = self.target.prefill_pipelined(prompt, self.cache, helper_cpu)[-1]
            else:
                logits = prefill_logits(self.target, prompt, self.cache)
        return choose_under(self.rules, logits, self.config.sampling, self.config.seed, len(prompt))

    def run(self, last: int, length: int, k_max: int) -> list[int]:
        """One Mirror step; on any draft failure, fall back and do a target-only step."""
        try:
            window = self._take_window(length, k_max)
        except DraftFailure as failure:
            self._fall_back(str(failure))
            return self.alone(last)
        tokens = list(window.tokens[:k_max])
        self.counters["last_window"] = len(tokens)
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
            verdict = verify_window(self.rules, logits, tokens, self.config.sampling, self.config.seed, length)
        suffix_s = time.perf_counter() - t1
        self.suffix_s = 0.8 * self.suffix_s + 0.2 * suffix_s if self.suffix_s else suffix_s
        self.counters["busy"].append((t0, time.perf_counter()))
        if tokens:  # a verification of draft tokens (a window of 0 is a plain target step)
            self.metrics.durations.setdefault("target_verify", []).append(time.perf_counter() - t0)
        # Phase 4: commit, tell the draft, roll back the rejected positions
        self.cache.rollback(base + 1 + verdict.num_accepted)
        self._send(verdict)
        self._count_exit(tokens, verdict, ids)
        self.metrics.record_step(len(tokens), verdict.num_accepted)
        return tokens[:verdict.num_accepted] + [verdict.next_token]

    def _prefix(self, tokens: list[int]):
        """The prefix layers, with the early-exit candidates when they can pay off ([T, 0] when not)."""
        use = self.config.early_exit == "on" or (
            self.config.early_exit == "auto" and self.wait_s <= 0.25 * self.suffix_s)
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
        return [choose_under(self.rules, logits[-1], self.config.sampling, self.config.seed, self.cache.length)]

    def _take_window(self, length: int, k_max: int) -> Window:
        # Phase 1: the rendezvous; the window must continue exactly the committed text
        t0 = time.perf_counter()
        with self.metrics.stage("target_wait"):
            message = self.link.take()
        self.wait_s = 0.8 * self.wait_s + 0.2 * (time.perf_counter() - t0)
        if isinstance(message, Fault):
            raise DraftFailure(f"draft failed: {message.reason}")
        _check_window(message, length, self.config, self.target.vocab_size)
        return message

    def _send(self, message) -> None:
        if self.alive:
            self.link.send(message)

    def _count_exit(self, tokens, verdict, ids) -> None:
        if verdict.num_accepted < len(tokens) and ids.shape[1]:
            self.counters["corrections"] += 1
            self.counters["exit_covered"] += int(verdict.next_token in ids[verdict.num_accepted])

    def _fall_back(self, reason: str) -> None:
        if self.alive:
            self.alive = False
            self.metrics.events.append(f"fallback to target-only: {reason}")
            self.link.close()


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


def _check_window(window, length: int, config: GenerationConfig, vocab_size: int) -> None:
    """Refuse a window that does not continue the committed text or is malformed."""
    if not isinstance(window, Window):
        raise DraftFailure(f"draft sent {type(window).__name__}, expected a window")
    if window.base_length != length:
        raise DraftFailure(f"draft window continues length {window.base_length}, committed is {length}")
    k = len(window.tokens)
    if not 1 <= k <= config.gamma:
        raise DraftFailure(f"draft window has {k} tokens, expected 1..{config.gamma}")
    if any(not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size) for t in window.tokens):
        raise DraftFailure("draft window has token ids outside the vocabulary")
