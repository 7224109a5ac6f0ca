"""Target-only steps of a batch on two cores: one call with a thread per core, or two calls at once.

A batched step can use both cores in two ways. "wide": one call through sessions with a thread per core; the
integer or fp32 products run on both, but a step also copies each group's keys and values and runs many small
nodes, and those use one thread. "split": the rows cut in two contiguous parts, each a one-thread call on a core
of its own, both at once; every node runs on both cores, but each core reads all the weights. Neither way wins
everywhere (docs/performance.md, how the batch decides): `CoreSplit` measures both at each batch size (TRIAL steps
each, then the one whose latest KEEP steps have the lower median, trying the other again every EXPLORE
steps as the rows grow).
A row's logits are the same bits either way (the target graphs compute a row alike in any call: exporters.exact_kv).
"""

from __future__ import annotations

import statistics

TRIAL = 3  # steps of each way before choosing, per batch size
EXPLORE = 32  # steps of a batch size between tries of the way not taken
KEEP = 5  # latest step times kept per batch size and way: their median decides (a first call's set-up is slow)
ROW_COST = 300  # one row's cost in positions attended, beside its keys (balancing the two parts)


def balanced_cut(lengths: list[int]) -> int:
    """Where to cut rows of `lengths` (positions each attends to) into two contiguous parts of like cost."""
    costs = [ROW_COST + n for n in lengths]
    total, best, best_gap, acc = sum(costs), 1, float("inf"), 0
    for cut in range(1, len(costs)):
        acc += costs[cut - 1]
        gap = abs(total - 2 * acc)
        if gap < best_gap:
            best, best_gap = cut, gap
    return best


class CoreSplit:
    """The way (wide or split) of each target-only step, by batch size, from measured step times."""

    def __init__(self):
        self.times: dict[tuple[int, str], list[float]] = {}  # (rows, way) -> its latest step seconds
        self.since: dict[int, int] = {}  # rows -> steps since the way not taken was tried
        self.splits = 0  # steps run split

    def way(self, rows: int) -> str:
        """"wide" or "split" for a step of `rows` rows."""
        wide, split = self.times.get((rows, "wide"), []), self.times.get((rows, "split"), [])
        if len(wide) < TRIAL or len(split) < TRIAL:
            return "wide" if len(wide) <= len(split) else "split"
        faster = "split" if statistics.median(split) < statistics.median(wide) else "wide"
        self.since[rows] = self.since.get(rows, 0) + 1
        if self.since[rows] >= EXPLORE:
            self.since[rows] = 0
            return "wide" if faster == "split" else "split"
        return faster

    def record(self, rows: int, way: str, seconds: float) -> None:
        """The time of a step of `rows` rows run `way`."""
        kept = self.times.setdefault((rows, way), [])
        kept.append(seconds)
        del kept[:-KEEP]
        self.splits += way == "split"
