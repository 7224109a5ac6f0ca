"""Prompt-lookup guesses (runtime.mirror.lookup)."""

import numpy as np
import torch

from mirror_rt.runtime.mirror.lookup import lookup_guesses, verify_guesses


def test_follows_the_latest_match_of_the_longest_ngram():
    text = [1, 2, 3, 9, 9, 2, 3, 7, 8, 4, 2, 3]
    # the trigram (4, 2, 3) never occurred before; the bigram (2, 3) last occurred at 5..6, followed by 7, 8
    assert lookup_guesses(text, 2) == [7, 8]
    assert lookup_guesses(text, 10) == [7, 8, 4, 2, 3]  # runs to the end of the text


def test_longer_ngram_wins_over_a_more_recent_shorter_one():
    text = [5, 1, 2, 6, 0, 2, 7, 5, 1, 2]
    assert lookup_guesses(text, 1) == [6]  # (5, 1, 2) at 0..2, not the later (2,) or (1, 2) alone


def test_nothing_when_no_ngram_repeats_or_no_room():
    assert lookup_guesses([1, 2, 3, 4], 3) == []
    assert lookup_guesses([1, 2, 1, 2], 0) == []
    assert lookup_guesses([], 3) == [] and lookup_guesses([7], 3) == []


def test_verify_guesses_counts_confirmed_prefix():
    """Row i's argmax confirms guess i; the first disagreement ends the run."""
    rows = np.zeros((3, 10), dtype=np.float32)  # ONNX Runtime / OpenVINO rows
    rows[0, 5] = rows[1, 9] = rows[2, 1] = 1.0
    assert verify_guesses(rows, [5, 9]) == 2 and verify_guesses(rows, [5, 8]) == 1 and verify_guesses(rows, []) == 0
    assert verify_guesses(torch.from_numpy(rows), [5, 9, 1]) == 3  # torch rows (the SS training draft)
