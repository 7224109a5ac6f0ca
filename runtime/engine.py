"""The engine: a target (and optional draft) ready to turn prompts into streamed text.

It prepares the prompt (chat template when the model has one), checks the context and the
vocabularies, picks the decoder for the mode (`ar` reference, `sd` vanilla speculative),
and turns committed tokens into text through `TextStream`. The decoders never see text;
the engine never sees logits. The cancel hook: `Generation.cancel()` (any thread) ends the
generation at the next step boundary; closing the decoder stops its workers (Mirror's draft
thread included), and the next generation starts from fresh caches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mirror_rt.runtime.config import GenerationConfig, make_config
from mirror_rt.runtime.metrics import Metrics
from mirror_rt.runtime.mirror import MirrorSettings, mirror_generate
from mirror_rt.runtime.reference import generate as reference_generate
from mirror_rt.runtime.speculative import speculative_generate
from mirror_rt.runtime.text_stream import TextStream
from mirror_rt.runtime.token_rules import TokenRules


class GenerationError(ValueError):
    """A request that cannot be served (one-line message)."""


@dataclass
class Generation:
    """A generation in progress: iterate for text pieces; text, tokens and stats fill in."""

    pieces: Iterator[str]
    text: str = ""  # the full text so far
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS excluded)
    stop_reason: str | None = None  # eos | stop_string | max_new_tokens | context | cancelled
    stats: dict = field(default_factory=dict)  # Metrics.summary() plus mode and models
    steps: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens committed) per step
    logprobs: list = field(default_factory=list)  # TokenLogprob per token of `tokens` so far, then the EOS
    durations: dict[str, list[float]] = field(default_factory=dict)  # Metrics.durations, once finished
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def __iter__(self):
        return self.pieces

    def cancel(self) -> None:
        """Stop at the next step boundary (safe from any thread); the stop reason becomes `cancelled`."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


class Engine:
    """A target model with an optional draft model and a shared tokenizer.

    Limitations:
    - batch size 1;
    - the draft must share the target's vocabulary (refused otherwise).
    """

    def __init__(self, target, tokenizer, draft=None, names: dict | None = None,
                 cpus: tuple[int, int] | None = None):
        self.target = target  # LoadedModel (with forward_prefix/forward_suffix for mirror mode)
        self.draft = draft  # LoadedModel, or None: the target drafts for itself (oracle draft)
        self.tokenizer = tokenizer
        self.names = names or {}
        self.cpus = cpus  # (target core, draft core) for mirror mode, or None: no pinning
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise GenerationError(f"vocabulary mismatch: target has {target.vocab_size} tokens, "
                                  f"draft has {draft.vocab_size}")

    @property
    def default_mode(self) -> str:
        """The mode of a request that names none: mirror where the target is split at its early exit, else sd."""
        return "mirror" if hasattr(self.target, "forward_prefix") else "sd"

    def prompt_ids(self, prompt, chat: bool = True) -> list[int]:
        """Token ids for a string (chat template applied if chat), a list of chat messages, or token ids."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.chat_prompt(prompt)
        if chat and self.tokenizer.has_chat_template:
            return self.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(self, prompt, config: GenerationConfig | None = None, chat: bool = True,
               **options) -> Generation:
        """Start generating; iterate the result for text pieces as they are committed.

        `options` override fields of `config` (max_new_tokens, mode, gamma, temperature,
        top_k, top_p, seed, stop_strings, ignore_eos) and of its token rules (constraint, logit_bias,
        presence_penalty, frequency_penalty, repetition_penalty, logprobs: see runtime.token_rules).
        """
        config = make_config(config, **options)
        if config.mode is None:
            config = replace(config, mode=self.default_mode)
        ids = self.prompt_ids(prompt, chat)
        if not ids:
            raise GenerationError("empty prompt")
        if len(ids) >= self.target.max_seq_len:
            raise GenerationError(f"prompt too long: {len(ids)} tokens, the model's context is "
                                  f"{self.target.max_seq_len} (at least one token must be generated)")
        rules = self.token_rules(config, ids)  # a grammar that cannot run is refused here, before any work
        gen = Generation(pieces=iter(()))
        gen.pieces = self._run(ids, config, gen, rules)
        return gen

    def generate(self, prompt, config: GenerationConfig | None = None, chat: bool = True,
                 **options) -> Generation:
        """Generate to the end; returns the finished `Generation` (.text, .tokens, .stats)."""
        gen = self.stream(prompt, config, chat, **options)
        for _ in gen:
            pass
        return gen

    def token_rules(self, config: GenerationConfig, ids) -> TokenRules | None:
        """The request's per-sequence token rules (None when it asks for none); GenerationError when they
        cannot run (a grammar llguidance refuses, a bias on an id outside the vocabulary)."""
        try:
            return TokenRules.create(config.rules, self.tokenizer, self.target.vocab_size, ids)
        except ValueError as exc:
            raise GenerationError(str(exc)) from None

    def _decoder(self, ids, config: GenerationConfig, metrics: Metrics, rules: TokenRules | None):
        if config.mode == "ar":
            return reference_generate(self.target, ids, config.max_new_tokens, config.sampling,
                                      config.seed, metrics, rules)
        if config.mode == "sd":
            draft = self.draft or self.target
            return speculative_generate(self.target, draft, ids, config.max_new_tokens,
                                        config.num_draft_tokens, config.sampling, config.seed, metrics, rules)
        if not hasattr(self.target, "forward_prefix"):
            raise GenerationError("mode 'mirror' needs a target split at its early exit "
                                  "(load a bundle, or a torch model through its split target)")
        target_cpu, draft_cpu = self.cpus or (None, None)
        settings = MirrorSettings(gamma=config.num_draft_tokens, sampling=config.sampling, seed=config.seed,
                                  branch_budget=config.branch_budget, min_window=config.min_window,
                                  draft_timeout_s=config.draft_timeout_s, early_exit=config.early_exit,
                                  target_cpu=target_cpu, draft_cpu=draft_cpu, lookup=config.draft_lookup)
        return mirror_generate(self.target, self.draft or self.target, ids, config.max_new_tokens, settings, metrics,
                               rules)

    def _run(self, ids, config: GenerationConfig, gen: Generation, rules: TokenRules | None) -> Iterator[str]:
        metrics = Metrics(prompt_tokens=len(ids))
        # a grammar's end is end-of-sequence: it stays a stop even under ignore_eos
        grammar = config.rules.constraint is not None
        eos = () if config.ignore_eos and not grammar else self.tokenizer.eos_token_ids
        text = TextStream(self.tokenizer, eos, config.stop_strings)
        steps = self._decoder(ids, config, metrics, rules)
        committed = 0  # tokens the decoder committed so far (their log-probabilities are rules.logprobs[:committed])
        try:
            for tokens in () if gen.cancelled else steps:  # cancelled before the start: not even a prefill
                now = time.perf_counter()
                metrics.first_token_at = metrics.first_token_at or now
                gen.steps.append((now, len(tokens)))
                if gen.cancelled:  # the step's tokens are dropped: a cancelled request wants nothing more
                    break
                for token in tokens:
                    delivered = len(text.tokens)
                    piece = text.push(token)
                    committed += 1
                    counted = len(text.tokens) > delivered or text.stop_reason == "eos"  # as usage counts them
                    if rules is not None and rules.logprobs is not None and counted:
                        gen.logprobs.append(rules.logprobs[committed - 1])
                    if piece:
                        gen.text += piece
                        yield piece
                    if text.done:
                        break
                if text.done or gen.cancelled:
                    break
            piece = "" if gen.cancelled else text.flush()
            if piece:
                gen.text += piece
                yield piece
        finally:
            steps.close()  # stops the decoder's workers (Mirror: the draft thread) before returning
            self._finish(gen, text, ids, config, metrics)

    def _finish(self, gen: Generation, text: TextStream, ids, config, metrics: Metrics) -> None:
        metrics.finish()
        gen.tokens = list(text.tokens)
        metrics.new_tokens = len(gen.tokens) + (text.stop_reason == "eos")
        room = self.target.max_seq_len - len(ids)
        gen.stop_reason = "cancelled" if gen.cancelled and not text.stop_reason else (
            text.stop_reason or ("context" if room < config.max_new_tokens else "max_new_tokens"))
        gen.stats = {"mode": config.mode, **self.names, **metrics.summary(), "stop_reason": gen.stop_reason}
        gen.durations = metrics.durations
        if config.mode in ("sd", "mirror") and self.draft is None:
            gen.stats["draft"] = "target (oracle draft)"
