"""Logit bias and repetition penalties on one logits row, where the row lives.

vLLM's order and definitions: the bias is added first (OpenAI's `logit_bias`, -100..100 per id);
then `repetition_penalty` (vLLM's extension) divides the positive logits and multiplies the negative
ones of every token seen in the prompt or the output; then `frequency_penalty` (times the count)
and `presence_penalty` (once) are subtracted for tokens of the output. Temperature and the rest of
the warping come later (`sampling.probabilities`). Only the few ids concerned travel to the
device; no vocabulary-sized array is made on the host. It knows nothing about grammars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mirror_rt.runtime.lazy_torch import import_torch

if TYPE_CHECKING:
    import torch


def add_bias(x: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """x [vocab] plus `bias` at its ids (a new tensor; ids past x's rows: a draft's embedding with less padding)."""
    torch = import_torch()
    bias = [(i, b) for i, b in bias if i < x.shape[-1]]
    ids = torch.tensor([i for i, _ in bias], dtype=torch.long, device=x.device)
    values = torch.tensor([b for _, b in bias], dtype=x.dtype, device=x.device)
    return x.index_add(0, ids, values)


def penalize(x: torch.Tensor, counts: Mapping[int, int], seen: torch.Tensor | None, repetition: float,
             frequency: float, presence: float) -> torch.Tensor:
    """x [vocab] with the penalties for the tokens generated so far (`output`) and the prompt's ids.

    Args:
        x: one logits row [vocab] (host view or device tensor); never modified in place.
        counts: {id: times generated so far} (ids at 0 may be left out).
        seen: the prompt's distinct ids [n] on x's device, or None (the repetition penalty only).
    Example: logits [2.0, -1.0, 0.5], counts {0: 2}, repetition 2, frequency 0.5, presence 1
        -> token 0: 2.0 / 2 - 0.5 * 2 - 1 = -1.0; the others unchanged.
    """
    torch = import_torch()
    counts = {i: c for i, c in counts.items() if c}
    if repetition != 1.0:
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        if seen is not None:
            ids = torch.cat([ids, seen])
        if ids.numel():
            chosen = x[ids]
            x = x.index_put((ids,), torch.where(chosen > 0, chosen / repetition, chosen * repetition))
    if counts and (frequency or presence):
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        amount = torch.tensor([frequency * c + presence for c in counts.values()], dtype=x.dtype, device=x.device)
        x = x.index_add(0, ids, -amount)
    return x
