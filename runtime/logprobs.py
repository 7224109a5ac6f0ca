"""The target's log-probabilities at committed positions, from its raw logits (vLLM's `raw_logprobs`).

Computed where the logits live; only each token's log-probability and the top-n are read back, never a vocabulary
row. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mirror_rt.runtime.sampling import as_tensor
from mirror_rt.runtime.transfer import import_torch, to_host

MAX_TOP = 20  # OpenAI's and vLLM's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token with its log-probability and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (id, log-probability), most likely first


def token_logprobs(rows, tokens: Sequence[int], top_n: int = 0) -> list[TokenLogprob]:
    """Log-probabilities of `tokens` [n] under raw logits `rows` [n, vocab] (row i: `tokens[i]`'s distribution), with
    the top `top_n` (0..MAX_TOP) of each row. Reads back one [n, 1 + 2 * top_n] table."""
    n = len(tokens)
    if n == 0:
        return []
    torch = import_torch()
    x = as_tensor(rows)[:n].to(torch.float64)
    norm = torch.logsumexp(x, dim=-1, keepdim=True)  # [n, 1]
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=x.device)
    parts = [x.gather(-1, ids[:, None]) - norm]
    if top_n:
        values, top_ids = torch.topk(x, min(top_n, x.shape[-1]), dim=-1)
        parts += [values - norm, top_ids.to(torch.float64)]
    table = to_host(torch.cat(parts, dim=-1))
    k = (table.shape[1] - 1) // 2
    return [TokenLogprob(int(t), float(r[0]), tuple((int(i), float(v)) for v, i in zip(r[1:1 + k], r[1 + k:])))
            for t, r in zip(tokens, table)]


def prompt_logprobs(target, ids: Sequence[int], top_n: int = 0, chunk: int = 256) -> list[TokenLogprob | None]:
    """Each prompt token's raw log-probability (None for the first), with the top `top_n`; computed in chunks over a
    cache of its own (a completion's `echo` with `logprobs`)."""
    cache = target.new_cache(len(ids) + 1)
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(ids) - 1, chunk):  # rows of positions start.. predict the tokens at start + 1..
        rows = target.forward(list(ids[start:start + chunk]), cache)
        out += token_logprobs(rows, ids[start + 1:start + 1 + chunk], top_n)
    return out
