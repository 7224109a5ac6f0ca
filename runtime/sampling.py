"""Logits to probabilities (temperature, top-k, top-p) and token choice, on host numpy arrays.

Every decoder (reference, speculative, mirror) draws through these functions, so the
target distribution `p` that speculative sampling must reproduce is defined in one place.
Greedy (temperature 0) never builds probabilities: it is an argmax over raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from logits."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with this cumulative probability; 1 = off

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Warped distribution per row: logits [T, vocab] -> probs [T, vocab] (float64)."""
    x = np.asarray(logits, dtype=np.float64) / config.temperature
    if config.top_k and config.top_k < x.shape[-1]:
        kth = np.partition(x, -config.top_k, axis=-1)[..., -config.top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if config.top_p < 1.0:
        p = _top_p(p, config.top_p)
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    # keep a token while the mass strictly before it is < top_p (the top token always stays)
    keep_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability row p [vocab]."""
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(p) - 1))


def keyed_rng(seed: int, stream: int, position: int) -> np.random.Generator:
    """A generator that depends only on (seed, stream, position), never on how many draws came before.

    Mirror draws this way so that a seeded request repeats exactly however the draft's precomputation
    was timed: the draft's token at position t uses stream 1, the target's window starting at t stream 2.
    Streams and positions never repeat within a request, so the draws stay independent (lossless).
    """
    return np.random.default_rng((seed & 0xFFFFFFFFFFFF, stream, position))


def choose(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator):
    """Pick a token from one logits row [vocab]; returns (token, probs or None when greedy)."""
    if config.greedy:
        return int(np.argmax(logits)), None
    p = probabilities(logits[None], config)[0]
    return sample(p, rng), p
