"""The engine thread: many generations at once through the engine's batched decoder, and their admission.

Up to `max_num_seqs` generations decode together and `max_queued` more wait; beyond that `submit` raises
`Overloaded` (a 503). The engine thread steps while any generation is live; events cross to asyncio through
`loop.call_soon_threadsafe` into the job's queue. Cancelling (client gone, drain, timeout) ends a generation at the
next step; a failing step ends those in flight with an error and the engine restarts from fresh rows. A job with
n choices submits n generations (seeds from `choice_config`), counting n against the capacity.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.engine import GenerationError
from mirror_rt.serving.origins import OriginTrail


class Overloaded(Exception):
    """Every row is taken and the queue is full."""


class Draining(Exception):
    """The server is shutting down and takes no new request."""


@dataclass
class Job:
    """One request's generation and its handoff to the event loop."""

    id: str
    prompt: list[int]  # token ids
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    origins: bool = False  # text events carry per-token entries (serving.origins) for stream_options.include_origins
    choices: int = 1  # n: generations decoding together
    constraint: str | None = None  # the kind of grammar the request runs under (for the metrics), or None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)  # the server passes when the request came in
    started: float | None = None  # when its first choice got a row of the batch
    first_text_at: float | None = None
    finished: float | None = None
    generations: list = field(default_factory=list)  # runtime.generation.Generation per choice, once submitted
    outcome: str = "pending"  # pending | done | cancelled | timeout | error
    error: BaseException | None = None
    record: object = None  # serving.records.RequestRecord, set by on_finish before the end event
    made: int = 0  # tokens committed so far over every choice (EOS included), as usage counts them
    progress: dict = field(default_factory=dict)  # choice index -> _Progress
    metered: dict = field(default_factory=dict)  # choice index -> steps its metrics counted (ServerMetrics.progress)
    cancel_requested: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, value=None) -> None:
        """Hand an event to the job's asyncio queue (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Progress:
    """What one choice has handed over so far."""

    steps: int = 0  # steps of its generation summed into the job's `made`
    logprobs: int = 0  # log-probability entries sent
    trail: OriginTrail | None = None  # the entries of its tokens, when the job asks for origins
    ended: bool = False


def choice_config(config: GenerationConfig, index: int) -> GenerationConfig:
    """Choice `index`'s settings: choice 0 keeps the request's seed, the others get independent ones."""
    if index == 0:
        return config
    seed = int(np.random.SeedSequence([config.seed & 0xFFFFFFFFFFFFFFFF, index]).generate_state(1)[0] >> 1)
    return replace(config, seed=seed)


class TooManyChoices(GenerationError):
    """A request with more choices (n) than the server has places, running and waiting: a 400 on `n`."""


class Scheduler:
    """The engine thread and its bounded admission."""

    def __init__(self, engine, max_queued: int, timeout_s: float | None = None,
                 on_change: Callable[[int, int], None] | None = None,
                 on_finish: Callable[[Job], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[int], None] | None = None):
        self.engine, self.max_queued, self.timeout_s = engine, max_queued, timeout_s
        self.queue_source = "--max-queued"  # what sets max_queued (a replica: its own queue, not the flag)
        self.on_change = on_change or (lambda running, waiting: None)
        self.on_finish = on_finish or (lambda job: None)
        self.on_death = on_death  # called when the engine thread dies (SystemExit and the like), before answering
        self.on_step = on_step or (lambda batch: None)  # after every step: sequences it decoded (0: none)
        self.jobs: dict[int, tuple[Job, int]] = {}  # id(generation) -> (job, choice index), while live
        self.closed = False
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="mirror-engine", daemon=True)
        self.thread.start()

    @property
    def capacity(self) -> int:
        """Generations admitted at once: the batch's rows plus the queue."""
        return self.engine.batch.max_num_seqs + self.max_queued

    # --- the event loop's side ---------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Admit a job (its n choices); Overloaded when rows and queue cannot take them, Draining when closed,
        GenerationError (a 400) when the engine cannot serve it."""
        return self.submit_all([job])[0]

    def submit_all(self, jobs: list[Job]) -> list[Job]:
        """Admit the jobs of one request (a text completion's prompts) together or none of them: as `submit`."""
        places = sum(job.choices for job in jobs)
        with self.lock:
            if self.closed:
                raise Draining()
            self._check_places(jobs, places)
            admitted = []
            try:
                for job in jobs:
                    self._admit(job)
                    admitted.append(job)
            except Exception:  # the engine refused part of it: take the others back (they never run)
                for job in admitted:
                    self._take_back(job)
                raise
            self._changed()
            self.lock.notify()
        if self.timeout_s:
            for job in jobs:
                timer = threading.Timer(self.timeout_s, self._time_out, (job,))
                timer.daemon = True
                timer.start()
        return jobs

    def _check_places(self, jobs: list[Job], places: int) -> None:
        """TooManyChoices when even an idle server cannot hold `places` generations, Overloaded when it cannot now."""
        asks = (f"{len(jobs)} prompts x n={jobs[0].choices}" if len(jobs) > 1 else f"n={jobs[0].choices}")
        if places > self.capacity:  # never: not even an idle server holds them (--max-queued bounds waits)
            raise TooManyChoices(f"{asks} needs {places} places at once and this server has "
                                 f"{self.capacity} ({self.engine.batch.max_num_seqs} decoding at once: "
                                 f"--max-num-seqs; {self.max_queued} waiting: {self.queue_source})")
        if len(self.jobs) + places > self.capacity:
            needs = (f"; this request's {asks} need {places}" if len(jobs) > 1
                     else f"; this request's {places} choices need as many" if places > 1 else "")
            raise Overloaded(f"{len(self.jobs)} of {self.capacity} places taken ({self.engine.batch.max_num_seqs} "
                             f"decoding at once, {self.max_queued} waiting){needs}")

    def _admit(self, job: Job) -> None:
        """Submit each of the job's choices to the engine (under the lock); all of them or none."""
        try:
            for index in range(job.choices):
                config = choice_config(job.config, index)
                gen = self.engine.submit(job.prompt, config, on_piece=self._piece, on_finish=self._finished)
                job.generations.append(gen)
                job.progress[index] = _Progress(trail=OriginTrail() if job.origins else None)
                self.jobs[id(gen)] = (job, index)
        except Exception:
            self._take_back(job)
            raise
        if job.cancel_requested.is_set():
            for gen in job.generations:
                gen.cancel()

    def _take_back(self, job: Job) -> None:
        for gen in job.generations:
            gen.cancel()
            self.jobs.pop(id(gen), None)
        job.generations.clear()
        job.progress.clear()

    def cancel(self, job: Job) -> None:
        """Stop `job` at the next step (a waiting one never runs); its end event follows."""
        job.cancel_requested.set()
        for gen in list(job.generations):
            gen.cancel()
        with self.lock:
            self.lock.notify()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def idle(self) -> bool:
        with self.lock:
            return not self.jobs

    def live_jobs(self) -> list[Job]:
        with self.lock:
            return list({id(job): job for job, _ in self.jobs.values()}.values())

    def cancel_all(self) -> None:
        """Cancel every admitted job (a drain past its deadline)."""
        for job in self.live_jobs():
            self.cancel(job)

    def abandon(self) -> None:
        """End every admitted job as cancelled now, without waiting for the engine's step (a server that stops)."""
        for job in self.live_jobs():
            job.outcome = "cancelled"
            job.post("end", "cancelled")

    def close(self, cancel_waiting: bool = True) -> None:
        """Take no new job; drop the waiting ones (they end as cancelled)."""
        jobs = self.live_jobs() if cancel_waiting else []
        with self.lock:
            self.closed = True
            waiting = [j for j in jobs if all(g.sequence.state == "waiting" for g in j.generations)]
            self.lock.notify_all()
        for job in waiting:
            self.cancel(job)

    # --- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.jobs and not self.closed:
                    self.lock.wait()
                if not self.jobs:
                    return
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 -- a failing step ends its requests, never the server
                self._fail(exc)
            except BaseException as exc:  # SystemExit and the like end the thread, never leave the clients waiting
                if self.on_death is not None:
                    self.on_death(exc)
                self._fail(exc)
                raise
            self._stepped()

    def _stepped(self) -> None:
        decoder = self.engine.current_decoder
        running = sum(1 for s in decoder.active if s.state == "running") if decoder is not None else 0
        self.on_step(running)  # every step, prompt-only and last ones too: the KV figures move in each
        self._changed()

    def _piece(self, gen, piece: str) -> None:
        entry = self.jobs.get(id(gen))
        if entry is None:
            return
        job, index = entry
        if job.first_text_at is None:  # it is in the batch now (it may finish within this very step)
            job.first_text_at = time.perf_counter()
            self._changed()
        job.started = job.started or gen.sequence.admitted
        self._hand_over(job, index, gen, piece)

    def _hand_over(self, job: Job, index: int, gen, piece: str) -> None:
        """Post a choice's piece with the tokens made so far, the log-probabilities since its last piece and,
        when asked, their origins."""
        progress = job.progress[index]
        job.made += sum(step.tokens for step in gen.steps[progress.steps:])
        progress.steps = len(gen.steps)
        logprobs, progress.logprobs = gen.logprobs[progress.logprobs:], len(gen.logprobs)
        trail = progress.trail
        origins = trail.entries(gen, piece) if trail is not None and (piece or trail.pending(gen)) else None
        job.post("text", (index, piece, job.made, logprobs, origins))

    def _finished(self, gen) -> None:
        with self.lock:
            entry = self.jobs.pop(id(gen), None)
        if entry is None:
            return
        job, index = entry
        job.started = job.started or gen.sequence.admitted
        progress = job.progress[index]
        if len(gen.logprobs) > progress.logprobs or (progress.trail is not None and progress.trail.pending(gen)):
            self._hand_over(job, index, gen, "")  # tokens whose text is empty (EOS) at the very end
        job.progress[index].ended = True
        job.post("choice_end", index)
        if job.outcome not in ("timeout", "error"):
            if gen.stop_reason == "error":
                job.outcome = "error"
                job.error = job.error or (gen.sequence.error if gen.sequence is not None else None)
            elif gen.cancelled:
                job.outcome = "cancelled"
        if all(p.ended for p in job.progress.values()):
            self._end(job, "done" if job.outcome == "pending" else job.outcome)

    def _time_out(self, job: Job) -> None:
        if any(not g.finished and not g.cancelled for g in job.generations):
            job.outcome = "timeout"
            for gen in job.generations:
                gen.cancel()

    def _fail(self, exc: BaseException) -> None:
        """A step failed: every live job ends with the error; the engine starts again from fresh rows."""
        jobs = self.live_jobs()
        with self.lock:
            self.jobs.clear()
        self.engine.reset()
        for job in jobs:
            job.error = exc
            self._end(job, "error")

    def _end(self, job: Job, outcome: str) -> None:
        job.outcome, job.finished = outcome, time.perf_counter()
        try:
            self.on_finish(job)
        finally:
            job.post("end", outcome)
        self._changed()

    def _changed(self) -> None:
        self.on_change(*self.engine.load())
