"""Target-only steps cut into calls over groups of rows of like lengths (runtime.batch.splits): the cut, its trial,
the sort (exactness with cuts and sorts: tests/test_batch.py)."""

from __future__ import annotations

from mirror_rt.runtime.batch.splits import TRIAL, RowSplit


def test_one_long_row_is_cut_off_when_a_call_costs_less_than_its_padding():
    lengths = [60, 70, 900, 65, 80]
    assert RowSplit(per_call=1000).best(lengths)[1] == [(0, 2), (2, 1), (3, 2)]
    assert RowSplit(per_call=100_000).best(lengths)[1] == [(0, 5)]  # calls too dear: one call
    assert RowSplit(per_call=1000).best([64] * 6)[1] == [(0, 6)]  # like lengths: nothing to cut


def test_a_cut_is_measured_against_the_whole_step_before_it_stays():
    split, lengths, key = RowSplit(per_call=1000), [60, 70, 900], ("a", "b", "c")
    ways = []
    for _ in range(2 * TRIAL):  # whole and cut in turn, each timed
        groups = split.groups(lengths, key)
        ways.append(split.way)
        split.record(0.030 if len(groups) == 1 else 0.020)
    assert ways == ["whole", "cut"] * TRIAL
    assert split.groups(lengths, key) == [(0, 2), (2, 1)] and split.way == "cut"  # the cut won: it stays
    assert split.per_call < 1000  # and the next cuts are proposed more readily
    losing = RowSplit(per_call=1000)
    for _ in range(2 * TRIAL):
        groups = losing.groups(lengths, key)
        losing.record(0.020 if len(groups) == 1 else 0.030)
    assert losing.groups(lengths, key) == [(0, 3)] and losing.per_call > 1000
    assert losing.groups(lengths, ("a", "b", "d")) == [(0, 3)] and losing.way == "whole"  # new rows: a new trial
    assert losing.seconds == {"whole": [], "cut": []}


def test_sorting_is_proposed_only_when_it_saves_more_than_a_call():
    assert RowSplit(per_call=1000).sort_pays([900, 60, 60, 60, 880, 70, 70])  # long rows apart
    assert not RowSplit(per_call=1000).sort_pays([60, 70, 880, 900])  # sorted already
    assert not RowSplit(per_call=100_000).sort_pays([900, 60, 60, 60, 880, 70, 70])
