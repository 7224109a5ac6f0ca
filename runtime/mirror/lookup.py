"""Prompt-lookup guesses: what followed the latest earlier occurrence of the text's last n-gram.

The draft's output is unchanged by them; only its cost moves. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import numpy as np

from mirror_rt.runtime.acceptance import matched
from mirror_rt.runtime.sampling import greedy_ids


def lookup_guesses(tokens: list[int], max_guesses: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to `max_guesses` tokens that followed the latest earlier match of the last n-gram (longest first), or []."""
    if max_guesses < 1 or len(tokens) <= min_ngram:
        return []
    text = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        tail = text[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)  # n-grams ending before the last token
        starts = np.flatnonzero((windows == tail).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return [int(t) for t in text[follow:follow + max_guesses]]
    return []


def verify_guesses(main_rows, guesses: list[int]) -> int:
    """How many guesses the main rows [len(guesses) + 1, vocab] confirm (greedy; row 0 follows the last line token).
    Example: guesses [5, 9], row argmaxes [5, 2, 7] -> 1 (5 confirmed, 9 rejected for 2)."""
    return matched(guesses, greedy_ids(main_rows[:len(guesses)])) if guesses else 0
