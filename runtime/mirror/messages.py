"""The small host-side messages the target and draft workers exchange (Mirror-SD protocol).

Target -> draft: `Start` (the prompt's first token), `EarlyExit` (top-kappa per window
position, sent after the target's prefix), `Verdict` (after its suffix), `Stop`.
Draft -> target: `Window` (the next tokens to verify), `Fault`.
Only ids, counts and kappa log-probs cross; never backend tensors, never a vocabulary row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirror_rt.runtime.acceptance import Verdict  # noqa: F401  (re-exported: part of the protocol)


@dataclass(frozen=True)
class Start:
    """Prefill is done: the committed text is the prompt plus `first_token`."""

    first_token: int


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
    q: np.ndarray | None  # unused (None): the target checks drafts against its own choices (coupled)
    reused: bool  # True when precomputed before the verdict arrived (a reuse hit)


@dataclass(frozen=True)
class Fault:
    """The draft worker failed; the target goes on alone."""

    reason: str


STOP = object()  # shutdown sentinel for the draft's inbox
