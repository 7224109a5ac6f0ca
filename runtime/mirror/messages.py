"""The small host-side messages the target and draft workers exchange (Mirror-SD protocol).

Per step only ids, counts and kappa log-probs cross (EarlyExit, Window, Verdict), and under rejection sampling the
window's q rows (the draft's distribution of each token, the one vocabulary row per token the rule needs); never
backend logits. Join hands over the draft's KV cache object and Move/Grow the KV pool, by reference (the draft
worker copies or grows them on its own thread).
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from mirror_rt.runtime.acceptance import Verdict  # noqa: F401  (re-exported: part of the protocol)
from mirror_rt.runtime.config import GenerationConfig


@dataclass(frozen=True)
class Join:
    """A sequence joins: its draft cache (a prefix of its committed text already in it), its committed text
    (prompt + output), its request's settings and the draft's fork of its token rules (None: no rules)."""

    cache: object
    committed: list[int]
    config: GenerationConfig
    draft: object = None  # runtime.mirror.draft_row.DraftConfig (None: its defaults)
    rules: object = None


@dataclass(frozen=True)
class Leave:
    """A sequence stops drafting: its cache is rolled back to committed text (a prefix of it) and its row dropped."""

    done: threading.Event = field(default_factory=threading.Event)  # set once handled


@dataclass(frozen=True)
class Move:
    """The sequence's pool row moves: copy it in `pool` (from its cache's row to `row`) and rebind its cache."""

    pool: object
    row: int
    done: threading.Event = field(default_factory=threading.Event)  # set once handled


@dataclass(frozen=True)
class Grow:
    """A pool the worker reads needs room for `positions` per row (new buffers: not while a forward runs)."""

    pool: object
    positions: int
    done: threading.Event = field(default_factory=threading.Event)  # set once handled


@dataclass(frozen=True)
class EarlyExit:
    """Early-exit candidates for the window in flight."""

    base_length: int  # committed length the window continues from
    window: tuple[int, ...]  # the window's own tokens d_1..d_k
    ids: np.ndarray  # [k+1, kappa] top-kappa ids; row j predicts the token after window[:j]
    logprobs: np.ndarray  # [k+1, kappa] their log-probabilities
    suffix_s: float = 0.0  # the target's running mean suffix time: when the verdict is expected


@dataclass(frozen=True)
class Window:
    """Draft tokens continuing the committed text of length `base_length`."""

    base_length: int  # committed length (prompt + generated) the tokens continue from
    tokens: tuple[int, ...]  # [k] draft ids
    reused: bool  # True when precomputed before the verdict arrived (a reuse hit)
    q: tuple | None = None  # rejection sampling: per token its draft distribution [vocab] (None: one-hot)


@dataclass(frozen=True)
class Fault:
    """The draft worker failed; the target goes on alone."""

    reason: str


STOP = object()  # shutdown sentinel for the draft's inbox
