"""`mirror-rt bench` on question files and methods it cannot use: one line before any model loads (an empty file
reported success with 0 questions, a string of turns became one question per character, no runnable method was
a ZeroDivisionError)."""

from __future__ import annotations

import json

import pytest

from mirror_rt.cli import main


@pytest.mark.parametrize("lines, says", [
    ([], "no questions in it"),
    (["", "  "], "no questions in it"),
    ([json.dumps({"question_id": 1, "category": "qa", "turns": "hello"})], "`turns` must be a non-empty list"),
])
def test_question_files_it_cannot_use_are_one_line(tmp_path, capsys, lines, says):
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(lines))
    assert main(["bench", "--data", str(data), "--methods", "ar", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("mirror-rt: error: ")


def test_no_method_is_one_line(tmp_path, capsys):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}))
    assert main(["bench", "--data", str(data), "--methods", ",", "--out", str(tmp_path / "out")]) == 2
    assert "--methods names no method" in capsys.readouterr().err
