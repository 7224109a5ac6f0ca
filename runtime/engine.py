"""The engine: a target (and optional draft) that turns prompts into streamed text, many at once.

`stream()` / `generate()` drive the batched decoder from the caller's thread; a server `submit`s many and calls
`step()` from its engine thread. The decoders never see text; the engine never sees logits.
`Generation.cancel()` (any thread) ends a generation at the next step boundary and frees its row.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder, KVTooLarge
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.config import GenerationConfig, make_config
from mirror_rt.runtime.generation import Generation, Step
from mirror_rt.runtime.mirror.stats import batch_stats
from mirror_rt.runtime.reference import token_budget
from mirror_rt.runtime.text_stream import TextStream
from mirror_rt.runtime.token_rules import TokenRules
from mirror_rt.runtime.values import is_integer, prompt_problem


class GenerationError(ValueError):
    """A request that cannot be served (one-line message)."""


class PromptError(GenerationError):
    """A prompt that cannot be served as given: not text, token ids or chat messages, or a token id outside the
    vocabulary (the server's 400 names `prompt`)."""


@dataclass(eq=False)
class _Live:
    """What the engine keeps of a running generation: the Generation only weakly, so that one its caller
    dropped (a stream left with `break`, never closed) is collected, cancelled, and leaves the batch."""

    ref: weakref.ref
    seq: Sequence
    text: TextStream

    @property
    def gen(self) -> Generation | None:
        return self.ref()


class Engine:
    """A target model with an optional draft model and a shared tokenizer, decoding a batch of requests.

    The draft must share the target's vocabulary (refused otherwise). Any number of threads may `stream` /
    `generate` / `submit` at once: one step runs at a time, whichever thread runs it."""

    def __init__(self, target, tokenizer, draft=None, names: dict | None = None,
                 cpus: tuple[int, int] | None = None, placement=None, manifest=None,
                 batch: BatchConfig | None = None, load_time_s: float | None = None, draft_auto: tuple = ()):
        self.target = target  # LoadedModel (runtime.backend; split at its early exit for mirror mode)
        self.draft = draft  # LoadedModel, or None: the target drafts for itself (oracle draft)
        self.tokenizer = tokenizer
        self.names = names or {}  # path, model, each role's device and precision (stats, logs, reports)
        self.load_time_s = load_time_s  # seconds until the engine was ready (every generation's stats carry it)
        self.draft_auto = tuple(draft_auto)  # what `--draft auto` timed and chose here (`mirror-rt devices` prints)
        self.cpus = cpus  # (target core, draft core) for mirror mode, or None: no pinning
        # where each role runs and what fell back (devices.placement.Placement); None: not assembled by devices/
        self.placement = placement
        self.manifest = manifest  # the bundle's exporters.manifest.BundleManifest; None: not a bundle
        self.batch = batch or BatchConfig()
        self._decoder: BatchDecoder | None = None
        self._live: dict[int, _Live] = {}  # id(sequence) -> its generation
        self._lock = threading.Lock()
        self._stepping = threading.Lock()  # one decoder step at a time, whichever thread drives
        self._ids = iter(range(1 << 62))
        if draft is not None and draft.vocab_size > target.vocab_size:  # (fewer: an embedding with less padding)
            raise GenerationError(f"vocabulary mismatch: target has {target.vocab_size} tokens, "
                                  f"draft has {draft.vocab_size}")
        # the draft worker stops before the interpreter tears down: one still inside ONNX Runtime at exit (a stream
        # left with `break` keeps its generation alive) aborts the process ("terminate called", SIGABRT)
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def default_mode(self) -> str:
        """The mode of a request that names none: mirror where the target is split at its early exit, else sd."""
        return "mirror" if self.target.capabilities.split else "sd"

    @property
    def decoder(self) -> BatchDecoder:
        """The batched decoder (made at the first request: its KV rows take memory)."""
        if self._decoder is None:
            self._decoder = BatchDecoder(self.target, self.draft, self.batch, cpus=self.cpus)
        return self._decoder

    def prompt_ids(self, prompt, chat: bool = True) -> list[int]:
        """Token ids for a string (chat template applied if chat; a plain string with what the tokenizer adds
        around a prompt, a BOS where it asks for one, as transformers and vLLM tokenize it), a list of chat
        messages (the template writes its own BOS), or token ids (taken as they are); PromptError for anything
        else (runtime.values)."""
        problem = prompt_problem(prompt)
        if problem:
            raise PromptError(problem)
        if not isinstance(prompt, str) and is_integer(prompt[0]):
            return [int(t) for t in prompt]
        if not isinstance(prompt, str):
            try:
                return self.tokenizer.chat_prompt(list(prompt))
            except ValueError as exc:  # no chat template, or one that refuses these messages
                raise PromptError(str(exc)) from None
        if chat and self.tokenizer.has_chat_template:
            return self.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def config_for(self, config: GenerationConfig | None = None, **options) -> GenerationConfig:
        """`config` with `options` (field names) applied and the mode resolved; GenerationError for a mode the
        engine cannot run, or for settings that are not valid (the library's own error, naming the setting)."""
        try:
            config = make_config(config, **options)
        except GenerationError:
            raise
        except ValueError as exc:
            raise GenerationError(str(exc)) from None
        if config.mode is None:
            config = replace(config, mode=self.default_mode)
        if config.mode == "mirror" and not self.target.capabilities.split:
            raise GenerationError("mode 'mirror' needs a target split at its early exit "
                                  "(load a bundle, or a torch model through its split target)")
        return config

    # --- one request, driven by the caller --------------------------------------------------

    def stream(self, prompt, config: GenerationConfig | None = None, chat: bool = True,
               **options) -> Generation:
        """Start generating; iterate the result for text pieces as they are committed.

        `options` override fields of `config` by their field names (max_new_tokens, mode, gamma,
        temperature, top_k, top_p, min_p, seed, stop_strings, ignore_eos, draft_lookup, ...) and of its token
        rules (constraint, logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_tokens, logprobs:
        runtime.token_rules).
        """
        gen = self.submit(self.prompt_ids(prompt, chat), self.config_for(config, **options))
        gen.pieces, gen.settle = self._drive(gen), self._settle
        return gen

    def generate(self, prompt, config: GenerationConfig | None = None, chat: bool = True,
                 **options) -> Generation:
        """Generate to the end; returns the finished `Generation` (.text, .tokens, .stats)."""
        gen = self.stream(prompt, config, chat, **options)
        for _ in gen:
            pass
        return gen

    def _drive(self, gen: Generation) -> Iterator[str]:
        try:
            while not gen.finished or gen.queued:
                if gen.queued:
                    yield gen.queued.pop(0)
                else:
                    self._step_for(gen)
            if gen.sequence.error is not None:  # this request's own failure (its grammar), not the batch's
                raise gen.sequence.error
        finally:  # closed early (Ctrl-C, a consumer that stopped reading, garbage collection): cancelled, it
            if not gen.finished:  # leaves at the next step; never stepped here (a collector may run this anywhere)
                gen.cancel()

    def _step_for(self, gen: Generation, settling: bool = False) -> None:
        """One step for `gen`, unless another thread's step already brought it its end or (reading, not
        `settling`) pieces to take."""
        with self._stepping:
            if not gen.finished and (settling or not gen.queued):
                self._step()

    def _settle(self, gen: Generation) -> None:
        """Step until `gen` (cancelled) has left the batch, whatever pieces it still holds."""
        while not gen.finished and not sys.is_finalizing():  # at exit nothing more runs
            self._step_for(gen, settling=True)

    # --- many requests, stepped by one thread ---------------------------------------------

    def submit(self, ids: list[int], config: GenerationConfig, on_piece=None, on_finish=None) -> Generation:
        """Queue a request (thread-safe); its pieces reach `on_piece`, its end `on_finish` (push mode), or its
        `pieces` iterator when `stream` drives it. GenerationError when it cannot be served."""
        if not ids:
            raise GenerationError("empty prompt")
        vocab = self.target.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:  # an embedding lookup past the table would fail the whole batch's step
            raise PromptError(f"prompt token id {outside} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.target.max_seq_len:
            raise GenerationError(f"prompt too long: {len(ids)} tokens, the model's context is "
                                  f"{self.target.max_seq_len} (at least one token must be generated)")
        config = self.config_for(config)  # the engine's mode where the request names none
        rules = self.token_rules(config, ids)  # a grammar that cannot run is refused here, before any work
        gen = Generation(on_piece=on_piece, on_finish=on_finish)
        budget = token_budget(len(ids), config.max_new_tokens, self.target.max_seq_len)
        seq = Sequence(f"seq-{next(self._ids)}", list(ids), config, budget, sink=self._on_tokens,
                       cancel_event=gen.cancel_event, rules=rules)
        gen.sequence = seq
        grammar = config.rules.constraint is not None  # a grammar's end is end-of-sequence, even under ignore_eos
        eos = () if config.ignore_eos and not grammar else self.tokenizer.eos_token_ids
        with self._lock:
            self._live[id(seq)] = _Live(weakref.ref(gen), seq, TextStream(self.tokenizer, eos, config.stop_strings,
                                                                            config.rules.min_tokens))
        weakref.finalize(gen, gen.cancel_event.set)  # dropped by its caller: cancelled (the event is the sequence's)
        try:
            self.decoder.add(seq)
        except KVTooLarge as exc:
            with self._lock:
                del self._live[id(seq)]
            raise GenerationError(str(exc)) from None
        return gen

    def token_rules(self, config: GenerationConfig, ids) -> TokenRules | None:
        """The request's per-sequence token rules (None when it asks for none); GenerationError when they
        cannot run (a grammar llguidance refuses, a bias on an id outside the vocabulary)."""
        try:
            return TokenRules.create(config.rules, self.tokenizer, self.target.vocab_size, ids)
        except ValueError as exc:
            raise GenerationError(str(exc)) from None

    def step(self) -> bool:
        """One decoder step (thread-safe); returns whether work remains. A step that fails ends every generation in
        flight (`reset`) before the error goes on."""
        with self._stepping:
            return self._step()

    def _step(self) -> bool:
        try:
            more = self.decoder.step()
        except Exception:
            self.reset()
            raise
        with self._lock:
            done = [live for live in self._live.values() if live.seq.state == "done"]
            for live in done:
                del self._live[id(live.seq)]
        for live in done:
            self._finish(live)
        return more

    def pending(self) -> int:
        """Generations submitted and not yet finished."""
        with self._lock:
            return len(self._live)

    @property
    def current_decoder(self) -> BatchDecoder | None:
        """The decoder if one was made (reading it never makes one: a server reads it from other threads)."""
        return self._decoder

    def load(self) -> tuple[int, int]:
        """(sequences holding a row of the batch, sequences waiting for one); (0, 0) before the first request."""
        decoder = self._decoder
        return (0, 0) if decoder is None else (len(decoder.active), len(decoder.waiting))

    def close(self) -> None:
        """Stop the decoder's draft worker (the engine stays usable)."""
        if self._decoder is not None:
            self._decoder.close()

    def reset(self) -> None:
        """After a failed step: every generation in flight ends (stop reason `error`, no callback: the caller
        answers them) and the decoder starts again from empty rows."""
        with self._lock:
            lives = list(self._live.values())
            self._live.clear()
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.close()
        for live in lives:
            gen = live.gen
            if gen is not None:
                gen.stop_reason, gen.finished = "error", True

    # --- tokens to text ---------------------------------------------------------------------

    def _on_tokens(self, seq: Sequence, tokens: list[int], drafted: int, accepted: int) -> None:
        live = self._live.get(id(seq))
        gen = live.gen if live is not None else None
        if gen is None:  # its caller dropped it: nobody reads its tokens (its finalizer cancelled it)
            return
        text = live.text
        first = len(seq.tokens) - len(tokens)  # the step's first token's index in the output
        flags = seq.rules.forced_flags if seq.rules is not None else None
        forced = tuple(j for j in range(len(tokens)) if flags and first + j < len(flags) and flags[first + j])
        gen.steps.append(Step(time.perf_counter(), len(tokens), drafted, accepted, forced))
        recorded = seq.rules.logprobs if seq.rules is not None else None
        for index, token in enumerate(tokens, first):
            delivered = len(text.tokens)
            piece = text.push(token)
            gen.tokens = text.tokens
            if text.stop_reason == "eos" and gen.end_token is None:
                gen.end_token = token
            if recorded is not None and (len(text.tokens) > delivered or text.stop_reason == "eos"):
                gen.logprobs.append(recorded[index])  # as usage counts the token
            if piece:
                self._emit(gen, piece)
            if text.done:
                kept = index - first + 1
                if kept < len(tokens):  # the text ended inside the step: what follows was never delivered
                    gen.steps[-1] = replace(gen.steps[-1], tokens=kept, drafted=min(drafted, kept),
                                            accepted=min(accepted, kept))
                    seq.metrics.trim_last_step(kept)
                seq.finish("stop")
                return

    def _emit(self, gen: Generation, piece: str) -> None:
        gen.text += piece
        if gen.on_piece is not None:
            gen.on_piece(gen, piece)
        else:
            gen.queued.append(piece)

    def _finish(self, live: _Live) -> None:
        gen, seq, text = live.gen, live.seq, live.text
        if gen is None:  # dropped by its caller: nobody to tell
            return
        if not gen.cancelled and seq.finish_reason != "cancelled":
            piece = text.flush()
            if piece:
                self._emit(gen, piece)
        metrics = seq.metrics
        metrics.finish()
        gen.tokens = list(text.tokens)
        metrics.new_tokens = len(gen.tokens) + (text.stop_reason == "eos")
        room = self.target.max_seq_len - len(seq.prompt)
        if seq.finish_reason == "cancelled" and not text.stop_reason:
            gen.stop_reason = "cancelled"
        elif seq.finish_reason == "error":  # its own grammar failed (seq.error), the batch went on
            gen.stop_reason = "error"
        else:
            gen.stop_reason = text.stop_reason or ("context" if room < seq.config.max_new_tokens else "max_new_tokens")
        gen.stats = {"mode": seq.config.mode, **self.names, "load_time_s": self.load_time_s, **metrics.summary(),
                     **batch_stats(seq), "stop_reason": gen.stop_reason}
        gen.durations = metrics.durations
        if seq.config.mode in ("sd", "mirror") and self.draft is None:
            gen.stats["draft"] = "target (oracle draft)"
        gen.finished = True
        if gen.on_finish is not None:
            gen.on_finish(gen)


def _close_at_exit(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()
