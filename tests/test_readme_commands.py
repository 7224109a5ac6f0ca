"""Every `mirror-rt` command line of the README's ```bash blocks parses (its flags and values are the CLI's), and
every question file it names (--data) is there in a fresh clone: the shipped sets (evaluation/data) by name. The
README's `bench` example then runs, cut down to a tiny model, from a folder outside the checkout."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from cli_support import ROOT, console

README = ROOT / "README.md"


def readme_commands() -> list[list[str]]:
    """The README's `mirror-rt ...` lines of ```bash blocks, continuations joined, comments dropped, shell variables
    (`D=...`) filled in."""
    commands, variables = [], {}
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if len(words) == 1 and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
                name, value = words[0].split("=", 1)
                variables[name] = value
            elif words and words[0] == "mirror-rt":
                shell = [i for i, w in enumerate(words) if w in ("<", ">", "|", "&&", ";", "&", "2>", "2>&1")]
                words = words[:shell[0]] if shell else words  # the shell's redirections and pipes
                commands.append([re.sub(r"\$([A-Z_]+)", lambda m: variables.get(m.group(1), m.group(0)), w)
                                 for w in words[1:]])
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) >= 20 and any(c[0] == "bench" for c in COMMANDS)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_readme_command_parses_and_its_data_is_shipped(argv, tmp_path, monkeypatch):
    from mirror_rt.cli.dispatch import build_parser
    from mirror_rt.evaluation.specbench import question_file

    monkeypatch.chdir(tmp_path)  # a fresh folder: nothing beside the checkout (../shared/...) to lean on
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"mirror-rt {' '.join(argv)}: the CLI refuses it (exit {exc.code})")
    data = getattr(args, "data", None)
    for name in [data] if isinstance(data, str) else data or []:
        assert question_file(name).is_file(), f"mirror-rt {' '.join(argv)}: --data {name} is not there"


def test_the_readme_bench_example_runs_from_anywhere(tmp_path):
    """The README's bench line (its data, no path), on the tiny model and one question, from an empty folder."""
    (bench,) = [c for c in COMMANDS if c[:1] == ["bench"] and "--data" in c]
    data = bench[bench.index("--data") + 1]
    out = tmp_path / "bench-out"
    proc = console("bench", "--data", data, "--limit", "1", "--methods", "ar", "--model", "tiny", "--max-new-tokens",
                   "4", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["summary"]["overall"]["ar-torch-1t"]["questions"] == 1


def test_the_shipped_questions_carry_their_license():
    data = Path(ROOT / "evaluation" / "data")
    assert (data / "SPECBENCH-LICENSE.txt").read_text().startswith("Apache License")
    assert sum(1 for line in (data / "specbench-dev.jsonl").read_text().splitlines() if line.strip()) == 240
