"""Replay drafts: a measuring instrument, not a draft to deploy (`mirror-rt bench --methods mirror-replay[:alpha]`,
`sd-replay[:alpha]`).

A replay draft proposes the target's own greedy continuation of the prompt, recorded by an `ar` run of the same
engine (once per prompt, outside the timed run), each proposed token kept with probability alpha (a seeded coin per
position), else replaced by a wrong token (one the target does not choose there). The real draft still runs every
forward the runtime asks of it, so its cost is real; only its logits are replaced by a row that is one-hot at the
replayed token. The runtime never knows: the target decides, so the output is `ar`'s whatever is proposed. It answers,
at any size and with random weights, what this runtime turns an acceptance alpha into.

Limitation: one request at a time (the bench's): the replay follows the prompt its runner set last.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mirror_rt.runtime.transfer import is_tensor

REPLAY_MODES = {"mirror-replay": "mirror", "sd-replay": "sd"}  # method -> the engine mode it runs
DEFAULT_ALPHA = 1.0  # `mirror-replay` alone: every proposed token is the target's (the ceiling of any draft)
UNPROPOSED = -1e9  # the logit of every token a replayed row does not propose (exp() of it is 0 in float32)


def replay_method(method: str) -> tuple[str, float] | None:
    """`mirror-replay:0.7` -> ("mirror", 0.7); `sd-replay` -> ("sd", DEFAULT_ALPHA); None for any other method.
    ValueError for an alpha that is not a number in [0, 1]."""
    name, _, alpha = method.partition(":")
    if name not in REPLAY_MODES:
        return None
    if not alpha:
        return REPLAY_MODES[name], DEFAULT_ALPHA
    try:
        value = float(alpha)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # (nan fails too)
        raise ValueError(f"bench method {method}: alpha must be a number in [0, 1] (the share of proposed tokens "
                         f"kept), got '{alpha}'")
    return REPLAY_MODES[name], value


@dataclass(frozen=True)
class Replay:
    """What the draft proposes after each position of one prompt's text: `proposed[p]` is its token at position p
    (p >= `start`, the prompt's length); positions past the recording are left to the draft's own logits."""

    start: int
    proposed: np.ndarray  # int64 [len(prompt) + recorded]


def replay_of(prompt: list[int], continuation: list[int], alpha: float, seed: int, vocab: int) -> Replay:
    """The replay of `continuation` (the target's greedy tokens after `prompt`): each token kept with probability
    `alpha` (the coin of position p is the same whenever p is drafted), else the next id (mod `vocab`): a token the
    target does not choose at p."""
    text = np.asarray(list(prompt) + list(continuation), dtype=np.int64)
    kept = np.random.default_rng([abs(seed), len(prompt)]).random(len(text)) < alpha
    wrong = (text + 1) % vocab
    return Replay(len(prompt), np.where(kept, text, wrong))


class ReplayDraft:
    """A draft model (runtime.backend.LoadedModel) that runs the real draft's forwards and replaces their logits, row
    by row, by a one-hot at the replayed token (`replay`, set before each request; None: the draft's own logits).
    Everything else (caches, pools, capabilities, threads) is the real draft's."""

    def __init__(self, draft):
        self.draft = draft
        self.replay: Replay | None = None

    def __getattr__(self, name):  # new_cache, new_pool, capabilities, vocab_size, set_threads, can_adopt...
        return getattr(self.__dict__["draft"], name)

    def forward(self, tokens, cache):
        start = cache.length
        return self._replayed(self.draft.forward(tokens, cache), start + 1)

    def forward_last(self, tokens, cache):
        start = cache.length
        return self._replayed(self.draft.forward_last(tokens, cache), start + len(tokens))

    def forward_streams(self, tokens, cache):
        start = cache.length
        main, streams = self.draft.forward_streams(tokens, cache)
        return self._replayed(main, start + 1), streams

    def forward_rows(self, tokens, pool, first, **options):
        """Rows of many sequences [B, T]: row b's positions start at its pool length before the call."""
        starts = [int(pool.lengths[first + b]) for b in range(len(tokens))]
        logits = self.draft.forward_rows(tokens, pool, first, **options)
        if self.replay is None:
            return logits
        logits = _writable(logits)
        for b, start in enumerate(starts):
            self._replay_rows(logits[b], start + 1)  # (a view: edited in place)
        return logits

    def _replayed(self, logits, first: int):
        """`logits` [T, vocab] (row j predicts position first + j) with every replayed row made one-hot (a tensor
        or a read-only array is copied first)."""
        if self.replay is None:
            return logits
        logits = _writable(logits)
        self._replay_rows(logits, first)
        return logits

    def _replay_rows(self, logits, first: int) -> None:
        """Make the rows of `logits` [T, vocab] whose positions the replay covers one-hot, in place."""
        replay = self.replay
        for position in range(max(first, replay.start), min(first + len(logits), len(replay.proposed))):
            j = position - first
            logits[j, :] = UNPROPOSED
            logits[j, int(replay.proposed[position])] = 0.0


def _writable(logits):
    """`logits` if they may be edited in place, else a copy (torch's are inference tensors; an array may be
    read-only)."""
    if is_tensor(logits):
        return logits.clone()
    return logits if logits.flags.writeable else logits.copy()


class Recordings:
    """The target's greedy continuation of each prompt, recorded by an `ar` run of `engine` (over the replay's own
    target object: the very text its speculative modes must give), once per prompt and length."""

    def __init__(self, engine):
        self.engine = engine
        self.recorded: dict[tuple, tuple[list[int], bool]] = {}  # prompt -> (tokens, ended before the budget)

    def continuation(self, prompt: list[int], config) -> list[int]:
        """The greedy tokens `ar` gives after `prompt` under `config` (its end-of-sequence token included)."""
        key = (tuple(prompt), repr(replace(config, mode="ar", max_new_tokens=1)))  # all but the length asked
        tokens, ended = self.recorded.get(key, ([], False))
        if not ended and len(tokens) < config.max_new_tokens:
            gen = self.engine.generate(list(prompt), replace(config, mode="ar"))
            ended = gen.end_token is not None or gen.stop_reason not in ("max_new_tokens", "context")
            tokens = list(gen.tokens) + ([gen.end_token] if gen.end_token is not None else [])
            self.recorded[key] = (tokens, ended)
        return tokens


def replay_engine(engine, draft: bool = True):
    """An engine over `engine`'s target and tokenizer with a decoder of its own (its own KV rows, prefix cache and
    load policy): its draft a `ReplayDraft` over `engine`'s draft (or over the target, for an engine whose target
    drafts for itself); `draft=False`: no draft (the recorder: its prompts leave the replays' prefix caches cold)."""
    from mirror_rt.runtime.engine import Engine

    replay = ReplayDraft(engine.draft or engine.target) if draft else None
    names = {**engine.names, "draft": f"{engine.names.get('draft', 'target')}, proposals replayed"}
    return Engine(engine.target, engine.tokenizer, replay, names, engine.cpus, engine.placement, engine.manifest,
                  batch=engine.batch, load_time_s=engine.load_time_s)
