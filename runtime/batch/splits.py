"""How a target-only step of the batch splits: calls per group of rows of like lengths, or two calls on two cores.

`RowSplit` (format-5 bundles) proposes and measures cuts into calls over contiguous groups of rows; `CoreSplit`
measures "wide" against "split" on two cores. A row's logits do not depend on its companions or its call, so no
choice here changes a token.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import statistics

import numpy as np

TRIAL = 2  # steps each way before choosing
WIN = 0.95  # a cut must take at most this share of the whole step's time
GROUP_COST = 300.0  # one more attention group inside a call (exporters.exact_kv), in positions attended


def cheapest_groups(lengths, max_groups: int, per_group: float) -> tuple[float, list[tuple[int, int]]]:
    """The cheapest cut of rows into at most `max_groups` contiguous groups (first row, rows), each costing
    `per_group` plus its rows times its longest length, and its cost: a pass per group over where the last
    group starts, until one more group saves nothing."""
    lengths = np.asarray(lengths, dtype=float)
    n = len(lengths)
    span = np.full((n + 1, n + 1), np.inf)  # span[i, j]: rows i..j-1 as one group
    for i in range(n):
        span[i, i + 1:] = np.maximum.accumulate(lengths[i:]) * np.arange(1, n - i + 1)
    span += per_group
    levels = [(span[0], np.zeros(n + 1, dtype=int))]  # per group count: (cost of rows 0..j-1, last group's start)
    for _ in range(max_groups - 1):
        cost, _ = levels[-1]
        total = cost[:, None] + span
        start = total.argmin(axis=0)
        best = total[start, np.arange(n + 1)]
        fewer = best >= cost  # as cheap with fewer groups
        if fewer.all():  # another group would save nothing either
            break
        levels.append((np.where(fewer, cost, best), np.where(fewer, -1, start)))
    cut, j, level = [], n, len(levels) - 1
    while j > 0:
        start = int(levels[level][1][j])
        if start >= 0:
            cut.append((start, j - start))
            j = start
        level -= 1
    return float(levels[-1][0][n]), cut[::-1]


class RowSplit:
    """Cuts of one decoder's target-only steps, and their measured verdicts."""

    def __init__(self, per_call: float = 3000.0, in_call: int = 0):
        self.per_call = per_call  # one more call's cost, in positions attended
        self.in_call = in_call  # groups the target's calls attend apart (exporters.exact_kv): then never a cut
        self.rows_key: tuple = ()  # the rows (sequence ids in row order) the trial is about
        self.seconds: dict[str, list[float]] = {"whole": [], "cut": []}
        self.way = "whole"  # the way of the current step
        self.splits = 0  # steps run as more than one call
        self.sorts = 0  # times the rows were sorted by length

    def groups(self, lengths: list[int], rows_key: tuple) -> list[tuple[int, int]]:
        """Contiguous groups (first row, rows) over the rows, whose lengths (positions each attends to in this
        call) are `lengths`, keyed by who holds them: [(0, rows)] or the proposed cut, as measured."""
        cut = [(0, len(lengths))] if self.in_call else self.best(lengths)[1]
        if len(cut) == 1:
            self.way = "whole"
            return cut
        if rows_key != self.rows_key:
            self.rows_key, self.seconds = rows_key, {"whole": [], "cut": []}
        whole, tried = self.seconds["whole"], self.seconds["cut"]
        if len(whole) < TRIAL or len(tried) < TRIAL:
            self.way = "whole" if len(whole) <= len(tried) else "cut"
        else:
            self.way = "cut" if min(tried) < WIN * min(whole) else "whole"
        if self.way == "cut":
            self.splits += 1
            return cut
        return [(0, len(lengths))]

    def record(self, seconds: float) -> None:
        """The time of the step `groups` planned; after the trial, the verdict moves `per_call`."""
        trial = self.seconds[self.way]
        if len(trial) >= TRIAL:
            return
        trial.append(seconds)
        whole, tried = self.seconds["whole"], self.seconds["cut"]
        if len(whole) == TRIAL and len(tried) == TRIAL:
            won = min(tried) < WIN * min(whole)
            self.per_call = min(max(self.per_call * (0.9 if won else 1.25), 500.0), 100_000.0)

    def sort_pays(self, lengths: list[int]) -> bool:
        """Whether the rows sorted by length cut cheaper than as they are, by more than one call."""
        if self.in_call or len(lengths) < 3 or lengths == sorted(lengths):
            return False  # (groups inside a call: swapping rows' KV cost more than it saved, measured)
        return self.best(lengths)[0] - self.best(sorted(lengths))[0] > self.per_call

    def best(self, lengths: list[int]) -> tuple[float, list[tuple[int, int]]]:
        """The cheapest contiguous cut into calls and its cost (positions), any number of calls."""
        return cheapest_groups(lengths, len(lengths), self.per_call)


CORE_TRIAL = 3  # steps of each way on two cores before choosing, per batch size
EXPLORE = 32  # steps of a batch size between tries of the way not taken
KEEP = 5  # latest step times kept per batch size and way: their median decides (a first call's set-up is slow)
ROW_COST = 300  # one row's cost in positions attended, beside its keys (balancing the two parts)


def balanced_cut(lengths: list[int]) -> int:
    """Where to cut rows of `lengths` (positions each attends to) into two contiguous parts of like cost."""
    acc = np.cumsum([ROW_COST + n for n in lengths])  # acc[i]: the cost of rows 0..i
    return int(np.argmin(np.abs(acc[-1] - 2 * acc[:-1]))) + 1 if len(acc) > 1 else 1


class CoreSplit:
    """The way (wide or split) of each step, by its shape (a target-only step's rows; a spread verify's (rows,
    window width)), from measured step times."""

    def __init__(self):
        self.times: dict[tuple, list[float]] = {}  # (shape, way) -> its latest step seconds
        self.since: dict = {}  # shape -> steps since the way not taken was tried
        self.splits = 0  # steps run split

    def way(self, shape) -> str:
        """"wide" or "split" for a step of `shape`."""
        wide, split = self.times.get((shape, "wide"), []), self.times.get((shape, "split"), [])
        if len(wide) < CORE_TRIAL or len(split) < CORE_TRIAL:
            return "wide" if len(wide) <= len(split) else "split"
        faster = "split" if statistics.median(split) < statistics.median(wide) else "wide"
        self.since[shape] = self.since.get(shape, 0) + 1
        if self.since[shape] >= EXPLORE:
            self.since[shape] = 0
            return "wide" if faster == "split" else "split"
        return faster

    def record(self, shape, way: str, seconds: float) -> None:
        """The time of a step of `shape` run `way`."""
        kept = self.times.setdefault((shape, way), [])
        kept.append(seconds)
        del kept[:-KEEP]
        self.splits += way == "split"
