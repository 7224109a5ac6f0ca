"""Benchmark arithmetic and rendering: speedups as SpecBench computes them (per question tokens/s over its turns,
averaged over questions, against the fastest target-only row of the same precision and the fastest overall), tables,
a chart (`write_chart`, matplotlib). Mean accepted length = committed tokens / target forwards.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mirror_rt.evaluation.specbench import Answer


def question_speed(answer: Answer) -> float:
    """Tokens per second of one question (all its turns)."""
    wall = sum(answer.wall_time)
    return sum(answer.new_tokens) / wall if wall > 0 else 0.0


def mean_speed(answers: list[Answer]) -> float:
    return sum(question_speed(a) for a in answers) / len(answers) if answers else 0.0


def mean_accepted_length(answers: list[Answer]) -> float | None:
    steps = [n for a in answers for turn in a.accept_lengths for n in turn]
    return sum(steps) / len(steps) if steps else None


def _mean_stat(answers: list[Answer], key: str) -> float | None:
    values = [s[key] for a in answers for s in a.stats if s.get(key) is not None]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Row:
    """What the report knows of a method besides its answers."""

    label: str = ""  # the path it runs and its precision (weights / compute / KV)
    precision: str = "fp32"  # its target's compute precision: rows are compared within one precision
    target_only: bool = False  # decodes with the target alone (a baseline candidate)
    ours: bool = False  # one of our engines (its text is the reference of its precision)
    target: str = ""  # which target it decodes with (path and precision): text compared within one target first
    replayed: float | None = None  # a replay row's alpha (evaluation.replay): its acceptance was replayed


def baselines(answers: dict[str, list[Answer]], rows: dict[str, Row]) -> tuple[dict[str, str], str]:
    """({precision: fastest target-only method of that precision}, fastest target-only method overall)."""
    only = [m for m in answers if rows.get(m, Row()).target_only] or list(answers)[:1]
    by_precision: dict[str, str] = {}
    for m in sorted(only, key=lambda m: -mean_speed(answers[m])):
        by_precision.setdefault(rows.get(m, Row()).precision, m)
    ordered = dict(sorted(by_precision.items(), key=lambda item: (item[0] != "fp32", item[0])))  # fp32 first
    return ordered, max(only, key=lambda m: mean_speed(answers[m]))


def references(answers: dict[str, list[Answer]], rows: dict[str, Row]) -> dict[str, str]:
    """Per method, the greedy text it is compared with: our first target-only row over the same target (speculation
    must give its text exactly), else of its precision, else of fp32 (a target-only row: another of its precision,
    else the fp32 one)."""
    by_target, by_precision = {}, {}
    for m in answers:
        row = rows.get(m, Row())
        if row.target_only and row.ours:
            by_precision.setdefault(row.precision, m)
            if row.target:
                by_target.setdefault(row.target, m)
    fallback = by_precision.get("fp32") or next(iter(by_precision.values()), None)
    out = {}
    for m in answers:
        row = rows.get(m, Row())
        ref = by_target.get(row.target) if row.target else None
        if ref is None or ref == m:
            ref = by_precision.get(row.precision, fallback)
        out[m] = fallback if ref == m else ref
    return {m: ref for m, ref in out.items() if ref is not None and ref != m}


def same_target(rows: dict[str, Row], method: str, reference: str) -> bool:
    """Whether `method` and its reference decode with the very same target (their texts must be equal)."""
    a, b = rows.get(method, Row()), rows.get(reference, Row())
    return a.target == b.target if a.target else a.precision == b.precision


def summarize(answers: dict[str, list[Answer]], baseline: str | dict[str, str],
              rows: dict[str, Row] | None = None, fastest: str | None = None) -> dict:
    """{category or 'overall': {method: figures}}: speedup against the baseline of the method's precision
    (`baseline`: one method for all, or {precision: method}), and against `fastest` when given."""
    rows = rows or {}
    groups: dict[str, dict[str, list[Answer]]] = defaultdict(dict)
    for method, items in answers.items():
        for a in items:
            groups[a.category].setdefault(method, []).append(a)
        groups["overall"][method] = list(items)
    table = {}
    for category, by_method in groups.items():
        speed = {m: mean_speed(items) for m, items in by_method.items()}
        table[category] = {}
        for m, items in by_method.items():
            own = baseline if isinstance(baseline, str) else baseline.get(rows.get(m, Row()).precision)
            table[category][m] = {"questions": len(items), "tokens_per_s": round(speed[m], 2),
                                  "speedup": _ratio(speed, m, own), "baseline": own,
                                  "speedup_vs_fastest": _ratio(speed, m, fastest) if fastest else None,
                                  **_figures(items)}
    return table


def _ratio(speed: dict[str, float], method: str, base: str | None) -> float | None:
    return round(speed[method] / speed[base], 3) if speed.get(base) else None


def _figures(items: list[Answer]) -> dict:
    """Acceptance and Mirror's figures of one method's answers."""
    means = ("reuse_hit_rate", "hidden_draft_share", "predicted_step_ms", "predicted_step_ms_pipelined",
             "measured_step_ms")
    return {"mean_accepted_length": _round(mean_accepted_length(items)),
            "prompt_tokens_per_s": _round(prompt_speed(items), 1),
            "decode_tokens_per_s": _round(decode_speed(items), 2),
            **{key: _round(_mean_stat(items, key)) for key in means}}


def prompt_speed(answers: list[Answer]) -> float | None:
    """Prompt tokens read per second of the target's prompt reading (its `target_prefill` stage) over every turn that
    reports both (ours; None where none does)."""
    turns = [(s["prompt_tokens"], s["stage_seconds"]["target_prefill"]) for a in answers for s in a.stats
             if s.get("prompt_tokens") and (s.get("stage_seconds") or {}).get("target_prefill")]
    seconds = sum(t for _, t in turns)
    return sum(n for n, _ in turns) / seconds if seconds > 0 else None


def decode_speed(answers: list[Answer]) -> float | None:
    """New tokens per second of decoding: each turn's wall time less its time to first token (the prompt's reading),
    over every turn that reports it (ours; None where none does). With few new tokens and long prompts, tokens/s
    (SpecBench's: prompt and answer) hides what speculation does to decoding; this does not."""
    turns = [(n - 1, wall - s["time_to_first_token_s"]) for a in answers
             for n, wall, s in zip(a.new_tokens, a.wall_time, a.stats) if s.get("time_to_first_token_s") is not None]
    seconds = sum(t for _, t in turns)
    return sum(n for n, _ in turns) / seconds if seconds > 0 else None


def decode_note(summary: dict, methods: list[str]) -> str | None:
    """The line under the table: each method's decode tokens/s overall and its ratio to its baseline's."""
    overall = summary.get("overall", {})
    speeds = {m: overall[m]["decode_tokens_per_s"] for m in methods if (overall.get(m) or {}).get(
        "decode_tokens_per_s")}
    if not speeds:
        return None
    items = []
    for m, speed in speeds.items():
        base = speeds.get(overall[m].get("baseline"))
        items.append(f"`{m}` {speed:.2f}" + (f" ({speed / base:.2f}x)" if base else ""))
    return ("Decode only (new tokens after the first, over wall time less time to first token; x: against the "
            "same baseline): " + ", ".join(items) + ".\n")


def _round(x, digits: int = 3):
    return None if x is None else round(x, digits)


def markdown_table(summary: dict, methods: list[str], labels: dict[str, str] | None = None) -> str:
    """One table: a row per category and method; `labels` gives each method's path and precision."""
    labels = labels or {}
    head = ("| category | method | path / precision | questions | tokens/s | speedup (same precision) | "
            "vs fastest | mean accepted length | reuse hit rate | hidden draft share | "
            "ms per step: predicted (§5) / predicted (pipelined) / measured | prompt tokens/s |")
    lines = [head, "|" + "---|" * 12]
    categories = sorted(c for c in summary if c != "overall") + ["overall"]
    for category in categories:
        for m in methods:
            f = summary[category].get(m)
            if f is None:
                continue
            pipelined = f.get("predicted_step_ms_pipelined")
            model = (f"{f['predicted_step_ms']:.1f} / {_fmt(pipelined)} / {f['measured_step_ms']:.1f}"
                     if f["predicted_step_ms"] is not None else "")
            lines.append(f"| {category} | {m} | {labels.get(m, '')} | {f['questions']} | {f['tokens_per_s']:.1f} | "
                         f"{_fmt(f['speedup'], 'x')} | {_fmt(f.get('speedup_vs_fastest'), 'x')} | "
                         f"{_fmt(f['mean_accepted_length'])} | "
                         f"{_fmt(f['reuse_hit_rate'])} | {_fmt(f['hidden_draft_share'])} | {model} | "
                         f"{_fmt(f.get('prompt_tokens_per_s'))} |")
    return "\n".join(lines) + "\n"


def replay_note(rows: dict[str, Row], methods: list[str]) -> str | None:
    """The line under a table with replay rows: their acceptance was replayed, not a draft's (None: none ran)."""
    replayed = {m: rows[m].replayed for m in methods if m in rows and rows[m].replayed is not None}
    if not replayed:
        return None
    return ("Acceptance was replayed in " + ", ".join(f"`{m}` (alpha {a:g})" for m, a in replayed.items()) +
            ": a measuring instrument, not a draft. The draft ran every forward (its cost is real) but proposed the "
            "target's own greedy text, each token kept with probability alpha (seeded), else a wrong token; the "
            "target decided. These rows show what the runtime turns acceptance alpha into, not what a draft gives.\n")


def _fmt(x, suffix: str = "") -> str:
    return "" if x is None else f"{x:.2f}{suffix}"


def count_mismatches(answers: dict[str, list[Answer]], reference: str | dict[str, str]) -> dict[str, list]:
    """Per method, the (question_id, turn) whose text differs from its reference method's (`reference`: one
    method for all, or {method: its reference}; methods without one are left out)."""
    out = {}
    for method, items in answers.items():
        ref_name = reference if isinstance(reference, str) else reference.get(method)
        if ref_name is None or method == ref_name:
            continue
        ref = {a.question_id: a.turns for a in answers.get(ref_name, [])}
        out[method] = [(a.question_id, i) for a in items for i, text in enumerate(a.turns)
                       if a.question_id in ref and i < len(ref[a.question_id]) and text != ref[a.question_id][i]]
    return out


def write_chart(summary: dict, methods: list[str], path) -> None:
    """PNG bar chart: speedup per category per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = sorted(c for c in summary if c != "overall") + ["overall"]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories)), 4))
    for i, m in enumerate(methods):
        values = [summary[c].get(m, {}).get("speedup") or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=m)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))])
    ax.set_xticklabels(categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
