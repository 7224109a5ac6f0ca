"""SpecBench formats: questions in (jsonl: `question_id`, `category`, `turns`), answers out (jsonl: `question_id`,
`category`, `model_id`, `choices[0]` with per turn `turns`, `new_tokens`, `wall_time`, `accept_lengths`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


class DataError(ValueError):
    """A malformed question file (one-line message naming the file and line)."""


SHIPPED = Path(__file__).parent / "data"  # question files installed with the package (evaluation/data)
DEFAULT_QUESTIONS = "specbench-dev"  # SpecBench's dev questions (Apache-2.0: data/SPECBENCH-LICENSE.txt)


def question_file(path: str | Path) -> Path:
    """`path`, or where it names a shipped file (`specbench-dev`, `short-prompts`, with or without `.jsonl`) and is
    no file here, that file of the package."""
    path = Path(path)
    shipped = SHIPPED / (path.name if path.suffix == ".jsonl" else f"{path.name}.jsonl")
    return shipped if not path.is_file() and path.parent == Path(".") and shipped.is_file() else path


def question_files(data, command: str) -> list[str]:
    """The question files given to `command` (one path or several); DataError when none is given or one is missing."""
    files = [] if data is None else [data] if isinstance(data, (str, Path)) else list(data)
    if not files:
        raise DataError(f"{command} needs question files: pass --data FILE.jsonl (SpecBench format: "
                        f"question_id, category, turns; e.g. {DEFAULT_QUESTIONS}, shipped with mirror-rt)")
    files = [str(question_file(f)) for f in files]
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise DataError(f"question file not found: {missing[0]}")
    if not any(read_questions(f) for f in files):  # read here: a malformed line is said before any model loads
        raise DataError(f"{command}: no questions in {', '.join(files)}")
    return [str(f) for f in files]


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


@dataclass
class Answer:
    """One method's answer to one question, turn by turn."""

    question_id: int | str
    category: str
    model_id: str
    turns: list[str] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    wall_time: list[float] = field(default_factory=list)
    accept_lengths: list[list[int]] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)  # our per-turn stats (not in SpecBench's format)

    def to_json(self) -> dict:
        choice = {"index": 0, "turns": self.turns, "new_tokens": self.new_tokens, "wall_time": self.wall_time,
                  "accept_lengths": self.accept_lengths}
        return {"question_id": self.question_id, "category": self.category, "answer_id": uuid.uuid4().hex,
                "model_id": self.model_id, "choices": [choice], "tstamp": time.time(), "stats": self.stats}

    @classmethod
    def from_json(cls, d: dict) -> Answer:
        c = d["choices"][0]
        return cls(d["question_id"], d.get("category", ""), d.get("model_id", ""), list(c["turns"]),
                   list(c["new_tokens"]), list(c["wall_time"]), [list(a) for a in c.get("accept_lengths", [])],
                   list(d.get("stats", [])))


def read_questions(path: str | Path, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """Questions from a SpecBench jsonl (or a shipped one by name: question_file); `limit` picks evenly across
    categories (round robin)."""
    path = question_file(path)
    if not path.is_file():
        raise DataError(f"question file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    questions, seen = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            turns = d["turns"]
            questions.append(Question(d["question_id"], d["category"], tuple(turns)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{number}: not a SpecBench question ({exc})") from None
        if seen.setdefault(repr(d["question_id"]), number) != number:  # answers and reports are keyed by it
            raise DataError(f"{path}:{number}: question_id {d['question_id']!r} again (first at line "
                            f"{seen[repr(d['question_id'])]})")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{path}:{number}: `turns` must be a non-empty list of strings")
    if categories:
        unknown = set(categories) - {q.category for q in questions}
        if unknown:
            raise DataError(f"{path}: no questions in categories {', '.join(sorted(unknown))}")
        questions = [q for q in questions if q.category in categories]
    return pick_evenly(questions, limit) if limit else questions


def pick_evenly(questions: list[Question], limit: int) -> list[Question]:
    """The first `limit` questions taking one per category in turn (file order within each)."""
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    picked, depth = [], 0
    while len(picked) < min(limit, len(questions)):
        for items in by_category.values():
            if depth < len(items) and len(picked) < limit:
                picked.append(items[depth])
        depth += 1
    return picked


def write_answers(path: str | Path, answers: list[Answer]) -> None:
    Path(path).write_text("".join(json.dumps(a.to_json(), ensure_ascii=False) + "\n" for a in answers))


def read_answers(path: str | Path) -> list[Answer]:
    return [Answer.from_json(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
