"""Draft tokens of many sequences in shared draft calls: one more token on each of several lines, one `forward_rows`
call over the draft pool per contiguous run of their rows (sd's windows in the decoder's thread, Mirror's lines in
the draft worker's).

Each row is fed what its cache lacks of its line's context (ragged, padded after its real positions, as the target's
windows are: padding never reaches a real position's logits and is never committed), and draws its token exactly as
`DraftRow._extend` does (runtime.sampling.choose_at at the target's position), so a line's tokens do not depend on
its companions. Lines whose drafting is no plain draw (token rules, SS streams, prompt lookup) draft alone.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from mirror_rt.runtime.mirror.draft_row import DraftRow, Line, _append
from mirror_rt.runtime.sampling import choose_at

PAD_MAX = 8  # a row fed more (a prompt caught up) runs alone: its companions are never padded past their room


def plain(row: DraftRow, line: Line, draft, pool) -> bool:
    """Whether `line`'s next token is a plain draw of `draft` over a row of `pool` (then it may share a call)."""
    config = row.config
    special = config.sampling.greedy and (row.draft.capabilities.streams or config.draft_lookup)
    return pool is not None and row.draft is draft and line.rules is None and not special


def wants(row: DraftRow, line: Line, context: list[int], k: int) -> bool:
    """Whether `line` (continuing `context`) needs another token to hold `k` and may have one (the context limit
    ends it, as DraftRow._extend)."""
    if len(line.tokens) >= k or line.ended:
        return False
    if row._room(len(context) + len(line.tokens)) <= 0:
        line.ended = True
        return False
    return True


def extend_lines(draft, pool, items: list[tuple[DraftRow, Line, list[int]]], free: Callable[[int], bool]) -> None:
    """One more token on each item's line (a row's line continuing `context`; one line per row): a draft call per
    contiguous run of their pool rows; `free(r)`: whether row r between two items may take padding (nobody else
    writes it now)."""
    feeds = {}
    for row, line, context in items:
        full = context + line.tokens
        row._rollback_to_prefix(full)
        feeds[row.cache.row] = (row, line, full[len(row.cache_tokens):])
    short = sorted(r for r in feeds if len(feeds[r][2]) <= PAD_MAX)
    for first, count in runs(short, free) + [(r, 1) for r in sorted(set(feeds) - set(short))]:
        width = max(len(feeds[r][2]) for r in range(first, first + count) if r in feeds)
        tokens = np.zeros((count, width), dtype=np.int64)
        for r in range(first, first + count):
            if r in feeds:
                feed = feeds[r][2]
                tokens[r - first, :len(feed)], tokens[r - first, len(feed):] = feed, feed[-1]
        t0 = time.perf_counter()
        logits = draft.forward_rows(tokens, pool, first)
        busy = (t0, time.perf_counter())
        for r in range(first, first + count):
            if r in feeds:
                _take(pool, *feeds[r], logits[r - first], busy)


def runs(rows: list[int], free: Callable[[int], bool]) -> list[tuple[int, int]]:
    """Contiguous runs (first row, rows) covering the sorted `rows`, joined across gaps only of `free` rows."""
    out: list[tuple[int, int]] = []
    for row in rows:
        if out and all(free(r) for r in range(out[-1][0] + out[-1][1], row)):
            out[-1] = (out[-1][0], row - out[-1][0] + 1)
        else:
            out.append((row, 1))
    return out


def _take(pool, row: DraftRow, line: Line, feed: list[int], logits, busy: tuple[float, float]) -> None:
    """The row's cache holds `feed` now; the draft's draw after it joins `line`."""
    pool.commit(row.cache.row, row.cache.length + len(feed))
    row.cache_tokens.extend(feed)
    row.stats.forwards += 1
    row.stats.busy.append(busy)
    if len(feed) == 1:  # one-token forwards: the unit of speculation work (as DraftRow._feed)
        seconds = busy[1] - busy[0]
        row.forward_s = 0.8 * row.forward_s + 0.2 * seconds if row.forward_s else seconds
    last = logits[len(feed) - 1]
    position = row.cache.length  # the line's context and tokens: the drafted token's position
    _append(line, choose_at(last, row.config.sampling, row.config.seed, position)[0], last)
