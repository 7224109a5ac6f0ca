"""Logits to probabilities (temperature, top-k, top-p) and token choice, where the logits live.

Every decoder chooses through `choose_at`. A position's draw is its own uniform (`position_uniform`: the seed, the
position and the stream, nothing else), so a seed gives the same draws on every device and in every mode. Three
streams: the target's draws (ar's text, corrections), the draft's own draws under rejection sampling (and the bonus
token, coupled with the draft's guess), and the acceptance tests of runtime.acceptance; independent of each other.
Greedy never builds probabilities (and never imports torch on host arrays). Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mirror_rt.runtime.transfer import host_ids, import_torch, is_tensor
from mirror_rt.runtime.values import is_integer, is_number

if TYPE_CHECKING:
    import torch


GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's sampling epsilon)


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from logits."""

    temperature: float = 0.0  # 0 = greedy (argmax); so is any temperature below GREEDY_BELOW
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with this cumulative probability; 1 = off
    min_p: float = 0.0  # keep the tokens at least this share of the most likely one's probability; 0 = off

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("min_p", self.min_p)):
            if not is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not is_integer(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"--min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or one so small that dividing by it overflows (5e-324 gave token 0 forever)."""
        return self.temperature < GREEDY_BELOW


def as_tensor(x) -> torch.Tensor:
    """A model output as a tensor: tensors as they are (on their device), host arrays viewed without a copy."""
    if is_tensor(x):
        return x
    torch = import_torch()
    return torch.from_numpy(np.ascontiguousarray(x))


def greedy_ids(logits) -> list[int]:
    """The argmax of each row of logits [T, vocab] (or of one row [vocab]): T ids are all that is read back.
    Ties go to the first maximum, in numpy (host arrays) as in torch."""
    return host_ids(logits.argmax(-1) if is_tensor(logits) else np.asarray(logits).argmax(-1))


def probabilities(logits, config: SamplingConfig) -> torch.Tensor:
    """Warped distribution per row: logits [T, vocab] -> probs [T, vocab] (float64, on the logits' device).
    vLLM's order: temperature, min-p, top-k, top-p."""
    torch = import_torch()
    x = as_tensor(logits).to(torch.float64) / config.temperature
    if config.min_p > 0:  # p / p_max = exp(x - x_max) >= min_p, in log space: no softmax of its own
        floor = x.max(dim=-1, keepdim=True).values + math.log(config.min_p)
        x = x.masked_fill(x < floor, -torch.inf)
    if config.top_k and config.top_k < x.shape[-1]:
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    p = torch.softmax(x, dim=-1)
    if config.top_p < 1.0:
        p = _top_p(p, config.top_p)
    return p


def _top_p(p: torch.Tensor, top_p: float) -> torch.Tensor:
    torch = import_torch()
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    # keep a token while the mass strictly before it is < top_p (the top token always stays)
    keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(dim=-1, keepdim=True)


_MASK64 = (1 << 64) - 1
TARGET_DRAWS, DRAFT_DRAWS, ACCEPTANCE = 0, 1, 2  # the uniform streams (`position_uniform`'s `stream`)


def position_uniform(seed: int, position: int, stream: int = TARGET_DRAWS) -> float:
    """The uniform in [0, 1) of the token at `position` (its index in prompt + output) of a request seeded `seed`,
    in `stream` (TARGET_DRAWS, DRAFT_DRAWS or ACCEPTANCE).

    It depends on nothing else, so a seeded request gives the same text alone or in any batch, and with the
    exact-seed rule the same in ar, sd and mirror. splitmix64 of (seed, position, stream); stream 0 adds nothing."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9 + stream * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def choose_at(logits, config: SamplingConfig, seed: int, first_position: int,
              stream: int = TARGET_DRAWS) -> list[int]:
    """The token chosen after each row of logits [T, vocab] (or one row [vocab]); row j at position
    first_position + j: greedy takes the argmax, sampling the inverse-CDF draw of the warped distribution at
    `position_uniform(seed, position, stream)`. Reads back T ids, never a vocabulary row."""
    if config.greedy:
        return greedy_ids(logits)
    return draw_at(logits, config, seed, first_position, stream)[0]


def draw_at(logits, config: SamplingConfig, seed: int, first_position: int,
            stream: int = TARGET_DRAWS) -> tuple[list[int], torch.Tensor]:
    """Sampling only: (the ids `choose_at` draws, the warped distributions [T, vocab] they were drawn from: a
    draft's q, on the logits' device)."""
    rows = as_tensor(logits)
    rows = rows[None] if rows.dim() == 1 else rows
    p = probabilities(rows, config)  # [T, vocab]
    uniforms = [position_uniform(seed, first_position + j, stream) for j in range(p.shape[0])]
    return inverse_cdf(p, uniforms, count=is_tensor(logits)), p


def inverse_cdf(p: torch.Tensor, uniforms: list[float], count: bool = True) -> list[int]:
    """Row j of p [T, vocab] (unnormalized allowed) drawn at uniforms[j]; reads back T ids."""
    torch = import_torch()
    cdf = torch.cumsum(p, dim=-1)
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=p.shape[-1] - 1)
    return host_ids(index, count=count)


def stack_rows(rows: list) -> torch.Tensor:
    """Probability rows (tensors or arrays, [vocab] each) -> [k, vocab] on the first row's device."""
    torch = import_torch()
    first = as_tensor(rows[0])
    return torch.stack([first] + [as_tensor(r).to(first.device) for r in rows[1:]])
