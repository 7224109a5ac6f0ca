"""`mirror-rt bench --rows`: a row per N with our cost and the target's precision, the CPU and kernels named, and
llama.cpp beside it or a line saying it is not installed (no timing asserted: figures are benchmarks')."""

from __future__ import annotations

import re

import pytest

from mirror_rt.cli import main
from mirror_rt.evaluation import rows_bench


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    from mirror_rt.exporters.export import export_bundle

    return export_bundle("tiny", tmp_path_factory.mktemp("rows"), progress=False)


def test_rows_prints_a_row_per_count(tiny_bundle, capsys):
    assert main(["bench", "--bundle", str(tiny_bundle), "--rows", "1,2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(line.split("|")[1]) for line in rows] == [1, 2]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) > 0 and cells[3] == "fp32"
    assert "best of 3" in out and "CPU: " in out and "kernels: " in out
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert rows_bench.NOT_INSTALLED in out and all(line.endswith("| - | - | - |") for line in rows)


@pytest.mark.parametrize("text,says", [("0,2", "whole numbers >= 1"), ("a", "whole numbers"), ("2,2", "twice"),
                                       (",", "whole numbers")])
def test_bad_rows_are_one_line(text, says, capsys):
    assert main(["bench", "--rows", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("mirror-rt: error: ")


def test_questions_still_need_out(capsys):
    """Without --rows, a bench of questions still needs its output folder (--data defaults to the shipped questions)."""
    assert main(["bench", "--methods", "ar"]) == 2
    assert "bench needs --out (or --rows" in capsys.readouterr().err


def test_untimed_one_row_forwards_come_first_on_both_sides():
    """The first forwards after a load map the weights' pages: WARM_UP one-row forwards (ours and llama.cpp's) run
    before the first N is timed, so one row is not measured cold."""
    from types import SimpleNamespace

    calls = []

    class Engine:
        target = SimpleNamespace(vocab_size=1000)
        names = {}

        def generate(self, ids, **_):
            calls.append(("ours", len(ids)))
            return SimpleNamespace(stats={"stage_seconds": {"target_prefill": 0.5}})

    class Llama:
        def reset(self):
            pass

        def n_vocab(self):
            return 1000

        def eval(self, ids):
            calls.append(("llama.cpp", len(ids)))

    costs = rows_bench.measure(Engine(), [4], Llama(), repeats=1, log=lambda line: None)
    warm = [("ours", 1), ("llama.cpp", 1)] * rows_bench.WARM_UP
    assert calls == warm + [("ours", 4), ("llama.cpp", 4)] and costs[0].seconds == 0.5


def test_fresh_ids_never_share_a_prefix_across_counts_and_runs():
    seen = {}
    for rows in (1, 2, 4, 8):
        for run in range(3):
            ids = rows_bench.fresh_ids(rows, run, 50000)
            assert len(ids) == rows and all(100 <= t < 50000 for t in ids)
            assert ids[0] not in seen, (rows, run, seen.get(ids[0]))
            seen[ids[0]] = (rows, run)


def test_bench_report_gives_prompt_tokens_per_s_beside_tokens_per_s():
    """Prompt tokens over the target's prompt-reading seconds, every turn that reports both (hand-computed); a peer
    that reports no stage leaves the cell empty."""
    from mirror_rt.evaluation import report
    from mirror_rt.evaluation.specbench import Answer

    turns = [{"prompt_tokens": 100, "stage_seconds": {"target_prefill": 0.5}},
             {"prompt_tokens": 50, "stage_seconds": {"target_prefill": 0.25, "target_verify": 9.0}}]
    ours = [Answer(1, "qa", "ar", ["a", "b"], [10, 10], [1.0, 1.0], [[], []], turns)]
    peer = [Answer(1, "qa", "llama-cpp", ["a"], [10], [1.0], [[]], [{"prompt_tokens": 100}])]
    assert report.prompt_speed(ours) == 200.0 and report.prompt_speed(peer) is None
    summary = report.summarize({"ar": ours, "llama-cpp": peer}, "ar")
    table = report.markdown_table(summary, ["ar", "llama-cpp"]).splitlines()
    assert table[0].endswith("| prompt tokens/s |") and table[1].count("---") == 12
    assert [line for line in table if "| overall | ar |" in line][0].endswith("| 200.00 |")
    assert [line for line in table if "| overall | llama-cpp |" in line][0].endswith("|  |")
