"""Target-only steps over rows of very different lengths: one call over all rows, or one call per group.

A batched call's attention reads every row up to the longest row's length (exporters.exact_kv slices the keys
to the longest row and masks the shorter ones), so one long prompt among short ones makes every row pay for its
length. Calls over contiguous groups of rows each pay their own longest length, but every call reads all the
weights again. `RowSplit` proposes the cut that minimizes

    calls * per_call + sum over groups of rows * longest      (in positions attended; per-row costs cancel)

and measures it: while the batch keeps its rows, the next steps run whole and cut in turn (`TRIAL` each; the
faster step of each counts), and the faster way stays until a row joins or leaves. `per_call`, one more call's
cost in positions, follows the verdicts (down when a cut wins, up when it loses), so on an engine whose calls
are dear (fp32 weights) it stops proposing cuts. Sorting the rows by length makes groups of like lengths
contiguous: proposed when the cut of the sorted rows saves more than one call over the cut of the rows as they
are (the decoder swaps rows: copies, paid once while the batch keeps its rows). A row's logits do not depend on
its companions (the target graphs are exact per row), so no choice here changes a token.
"""

from __future__ import annotations

TRIAL = 2  # steps each way before choosing
WIN = 0.95  # a cut must take at most this share of the whole step's time


class RowSplit:
    """Cuts of one decoder's target-only steps, and their measured verdicts."""

    def __init__(self, per_call: float = 3000.0):
        self.per_call = per_call  # one more call's cost, in positions attended
        self.rows_key: tuple = ()  # the rows (sequence ids in row order) the trial is about
        self.seconds: dict[str, list[float]] = {"whole": [], "cut": []}
        self.way = "whole"  # the way of the current step
        self.splits = 0  # steps run as more than one call
        self.sorts = 0  # times the rows were sorted by length

    def groups(self, lengths: list[int], rows_key: tuple) -> list[tuple[int, int]]:
        """Contiguous groups (first row, rows) over the rows, whose lengths (positions each attends to in this
        call) are `lengths`, keyed by who holds them: [(0, rows)] or the proposed cut, as measured."""
        cut = self.best(lengths)[1]
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
        if len(lengths) < 3 or lengths == sorted(lengths):
            return False
        return self.best(lengths)[0] - self.best(sorted(lengths))[0] > self.per_call

    def best(self, lengths: list[int]) -> tuple[float, list[tuple[int, int]]]:
        """The cheapest contiguous cut and its cost (positions): one pass over where the last group starts."""
        n = len(lengths)
        cost = [0.0] + [float("inf")] * n  # cost[j]: rows 0..j-1 cut at their cheapest
        start = [0] * (n + 1)
        for j in range(1, n + 1):
            longest = 0
            for i in range(j - 1, -1, -1):  # the last group is rows i..j-1
                longest = max(longest, lengths[i])
                total = cost[i] + self.per_call + (j - i) * longest
                if total < cost[j]:
                    cost[j], start[j] = total, i
        cut, j = [], n
        while j > 0:
            cut.append((start[j], j - start[j]))
            j = start[j]
        return cost[n], cut[::-1]
