"""One engine, one generation at a time: a FIFO of jobs run by the engine thread.

A job with n choices runs its n generations one after another (each its own seed, derived from the
request's by `choice_config`, and its own token rules); its events carry the choice's index.

The engine owns both devices (Mirror runs target and draft at once), so generations run one
after another in a dedicated thread; the asyncio loop never blocks on one. A job's text and its
end cross to asyncio through `loop.call_soon_threadsafe` into the job's own asyncio queue.
Admission is bounded: one running plus `max_queued` waiting, beyond that `submit` raises
`Overloaded` at once (the app answers 503). Cancelling a queued job removes it (it never runs);
cancelling the running one stops it at the next step boundary (`Generation.cancel`). A timeout
cancels a generation that runs past `timeout_s`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from mirror_rt.runtime.config import GenerationConfig


class Overloaded(Exception):
    """The queue is full."""


class Draining(Exception):
    """The server is shutting down and takes no new request."""


@dataclass
class Job:
    """One request's generation and its handoff to the event loop."""

    id: str
    prompt: list[int]  # token ids
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_text_at: float | None = None
    finished: float | None = None
    choices: int = 1  # n: generations run one after another
    constraint: str | None = None  # the kind of grammar the request runs under (for the metrics), or None
    generation: object = None  # runtime.engine.Generation running (or the last one)
    generations: list = field(default_factory=list)  # every choice's Generation so far, by index
    outcome: str = "pending"  # pending | done | cancelled | timeout | error
    error: BaseException | None = None
    record: object = None  # serving.records.RequestRecord, set by on_finish before the end event
    cancel_requested: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, value=None) -> None:
        """Hand an event to the job's asyncio queue (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Scheduler:
    """The engine thread and its bounded FIFO."""

    def __init__(self, engine, max_queued: int, timeout_s: float | None = None,
                 on_change: Callable[[int, int], None] | None = None,
                 on_finish: Callable[[Job], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None):
        self.engine, self.max_queued, self.timeout_s = engine, max_queued, timeout_s
        self.on_change = on_change or (lambda running, waiting: None)
        self.on_finish = on_finish or (lambda job: None)
        self.on_death = on_death  # called when the engine thread dies (SystemExit and the like), before answering
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.closed = False
        self.lock = threading.Condition()
        self.counter = itertools.count()
        self.thread = threading.Thread(target=self._loop, name="mirror-engine", daemon=True)
        self.thread.start()

    # --- the event loop's side ---------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue a job; Overloaded when one runs and `max_queued` wait, Draining when closed."""
        with self.lock:
            if self.closed:
                raise Draining()
            if len(self.waiting) + (self.running is not None) >= 1 + self.max_queued:
                raise Overloaded()
            self.waiting.append(job)
            self._changed()
            self.lock.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Stop `job`: dropped if still queued (it never runs), else ended at the next step."""
        job.cancel_requested.set()
        with self.lock:
            if job in self.waiting:
                self.waiting.remove(job)
                self._changed()
                self._end(job, "cancelled")
                return
        if job.generation is not None:
            job.generation.cancel()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def idle(self) -> bool:
        with self.lock:
            return self.running is None and not self.waiting

    def cancel_all(self) -> None:
        """Cancel every queued and running job (a drain past its deadline)."""
        with self.lock:
            jobs = list(self.waiting) + ([self.running] if self.running is not None else [])
        for job in jobs:
            self.cancel(job)

    def close(self, cancel_waiting: bool = True) -> None:
        """Take no new job; drop the queued ones (they end as cancelled)."""
        with self.lock:
            self.closed = True
            dropped = list(self.waiting) if cancel_waiting else []
            for job in dropped:
                self.waiting.remove(job)
            self._changed()
            self.lock.notify_all()
        for job in dropped:
            job.cancel_requested.set()
            self._end(job, "cancelled")

    # --- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.closed:
                    self.lock.wait()
                if not self.waiting:
                    return
                job = self.running = self.waiting.popleft()
                self._changed()
            try:
                self._run(job)
            finally:
                with self.lock:
                    self.running = None
                    self._changed()

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        timer = None
        try:
            if self.timeout_s:
                timer = threading.Timer(self.timeout_s, self._time_out, (job,))
                timer.daemon = True
                timer.start()
            for index in range(job.choices):
                gen = self.engine.stream(job.prompt, choice_config(job.config, index))
                job.generation = gen
                job.generations.append(gen)
                if job.cancel_requested.is_set() or job.outcome == "timeout":
                    gen.cancel()
                _hand_over(job, gen, index)
                job.post("choice_end", index)
                if gen.cancelled:
                    break
        except Exception as exc:  # noqa: BLE001 -- any engine failure ends this request, never the server
            job.error = exc
            self._end(job, "error")
            return
        except BaseException as exc:  # SystemExit and the like end the thread, never leave the client waiting
            if self.on_death is not None:
                self.on_death(exc)
            job.error = exc
            self._end(job, "error")
            raise
        finally:
            if timer is not None:
                timer.cancel()
        outcome = job.outcome if job.outcome == "timeout" else "cancelled" if gen.cancelled else "done"
        self._end(job, outcome)

    def _time_out(self, job: Job) -> None:
        if job.generation is not None and not job.generation.cancelled:
            job.outcome = "timeout"
            job.generation.cancel()

    def _end(self, job: Job, outcome: str) -> None:
        job.outcome, job.finished = outcome, time.perf_counter()
        try:
            self.on_finish(job)
        finally:
            job.post("end", outcome)

    def _changed(self) -> None:
        self.on_change(int(self.running is not None), len(self.waiting))


def choice_config(config: GenerationConfig, index: int) -> GenerationConfig:
    """Choice `index`'s settings: choice 0 keeps the request's seed, the others get independent ones."""
    if index == 0:
        return config
    seed = int(np.random.SeedSequence([config.seed & 0xFFFFFFFFFFFFFFFF, index]).generate_state(1)[0] >> 1)
    return replace(config, seed=seed)


def _hand_over(job: Job, gen, index: int) -> None:
    """Post each text piece with the tokens committed so far (a running sum over the steps: O(1) a piece)
    and the log-probabilities of the tokens delivered since the last piece."""
    seen = made = sent = 0
    for piece in gen:
        job.first_text_at = job.first_text_at or time.perf_counter()
        for _, count in gen.steps[seen:]:
            made += count
        seen = len(gen.steps)
        logprobs, sent = gen.logprobs[sent:], len(gen.logprobs)
        job.post("text", (index, piece, made, logprobs))
    if len(gen.logprobs) > sent:  # tokens whose text is empty (special tokens) at the very end
        job.post("text", (index, "", made, gen.logprobs[sent:]))
