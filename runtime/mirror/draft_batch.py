"""Draft tokens of many sequences in shared draft calls: one more token on each of several lines, one `forward_rows`
call over the draft pool per contiguous run of their rows (sd's windows in the decoder's thread, Mirror's lines in
the draft worker's).

Each row is fed what its cache lacks of its line's context and draws its token exactly as `DraftRow._extend` does
(`DraftRow._draw`: its own stream and q row under rejection sampling, the target's uniform under exact-seed), so
a line's tokens do not depend on its companions. Every
shared call feeds one position per row: drafts' graphs need not take windows of many positions on many rows at once
(ONNX Runtime's GroupQueryAttention refuses them with past KV: the default model's int8 draft). A row a few positions
behind (a window fully accepted: its last token and the bonus) catches up one position per call, drawing nothing
until it is level; one further behind (a prompt) runs alone. Prompt-lookup guesses (greedy requests) are fed only
to a row that drafts alone, checked as `_extend_with_lookup`. Lines under token rules or SS streams draft alone
(DraftRow). A chosen-from row is copied out of the call's logits (lines keep it, not the call's).
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from mirror_rt.runtime.mirror.draft_row import DraftRow, Line, _append
from mirror_rt.runtime.mirror.lookup import verify_guesses
from mirror_rt.runtime.sampling import greedy_ids

CATCH_UP = 4  # a row short of this many positions catches up one a shared call (more: a call of its own)


def plain(row: DraftRow, line: Line, draft, pool) -> bool:
    """Whether `line`'s next token is a plain draw of `draft` over a row of `pool`, with prompt-lookup guesses where
    the request has them (then it may share a call; SS streams and token rules draft alone)."""
    streams = row.config.sampling.greedy and row.draft.capabilities.streams
    return pool is not None and row.draft is draft and line.rules is None and not streams


def _guesses(row: DraftRow, line: Line, full: list[int]) -> list[int]:
    """Prompt-lookup guesses fed after `full` (greedy requests with draft_lookup, as DraftRow._extend_with_lookup)."""
    if not (row.config.sampling.greedy and row.config.draft_lookup):
        return []
    guesses = row._lookup(line, full)
    row.stats.guessed += len(guesses)
    return guesses


def wants(row: DraftRow, line: Line, context: list[int], k: int) -> bool:
    """Whether `line` (continuing `context`) needs another token to hold `k` and may have one (the context limit
    ends it, as DraftRow._extend)."""
    if len(line.tokens) >= k or line.ended:
        return False
    if row._room(len(context) + len(line.tokens)) <= 0:
        line.ended = True
        return False
    return True


def extend_lines(draft, pool, items: list[tuple[DraftRow, Line, list[int]]], free: Callable[[int], bool],
                 **call) -> None:
    """One more token on each item's line (a row's line continuing `context`; one line per row): a draft call per
    contiguous run of their pool rows; `free(r)`: whether row r between two items may take padding (nobody else
    writes it now); `call`: options of those calls (`wide=True`: on every core)."""
    feeds = {}
    for row, line, context in items:
        full = context + line.tokens
        row._rollback_to_prefix(full)
        guesses = _guesses(row, line, full) if len(items) == 1 else []  # (they would keep it out of shared calls)
        feed = full[len(row.cache_tokens):] + guesses
        if len(items) > 1 and 1 < len(feed) <= CATCH_UP:  # one position this call, nothing drawn yet
            feed, guesses = feed[:1], None
        feeds[row.cache.row] = (row, line, feed, guesses)
    one = sorted(r for r in feeds if len(feeds[r][2]) == 1)  # rows fed one token each share calls
    for first, count in runs(one, free) + [(r, 1) for r in sorted(set(feeds) - set(one))]:
        width = max(len(feeds[r][2]) for r in range(first, first + count) if r in feeds)
        tokens = np.zeros((count, width), dtype=np.int64)
        for r in range(first, first + count):
            if r in feeds:
                feed = feeds[r][2]
                tokens[r - first, :len(feed)], tokens[r - first, len(feed):] = feed, feed[-1]
        t0 = time.perf_counter()
        logits = draft.forward_rows(tokens, pool, first, **call)
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


def _take(pool, row: DraftRow, line: Line, feed: list[int], guesses: list[int] | None, logits,
          busy: tuple[float, float]) -> None:
    """The row's cache holds `feed` now, but for rejected guesses; the draft's draw after the line (greedy: and
    after each confirmed guess) joins `line`. `guesses` None: `feed` is a step of a catch-up, nothing is drawn."""
    if guesses is None:
        pool.commit(row.cache.row, row.cache.length + len(feed))
        row.cache_tokens.extend(feed)
        row.stats.busy.append(busy)
        return
    offset = len(feed) - len(guesses) - 1  # the row that predicts the token after the line
    kept = verify_guesses(logits[offset:], guesses)
    rejected = len(guesses) - kept
    pool.commit(row.cache.row, row.cache.length + len(feed) - rejected)
    row.cache_tokens.extend(feed[:len(feed) - rejected])
    row.stats.forwards += 1
    row.stats.rollbacks += rejected > 0
    row.stats.guesses_kept += kept
    row.stats.busy.append(busy)
    if len(feed) == 1:  # one-token forwards: the unit of speculation work (as DraftRow._feed)
        seconds = busy[1] - busy[0]
        row.forward_s = 0.8 * row.forward_s + 0.2 * seconds if row.forward_s else seconds
    if guesses:  # greedy: the line's next token and one more per confirmed guess
        rows = logits[offset:offset + kept + 1]
        for token, chosen_from in zip(greedy_ids(rows), rows):
            _append(line, token, _own(chosen_from))
        return
    last = logits[offset]
    position = row.cache.length  # the line's context and tokens: the drafted token's position
    token, q = row._draw(last, position)  # the row's own draw (and its q under rejection sampling), as _extend's
    _append(line, token, _own(last), q)


def _own(logits_row):
    """A row of a call's logits as an array of its own (a host view would keep the whole call's logits alive)."""
    return logits_row.copy() if isinstance(logits_row, np.ndarray) else logits_row
