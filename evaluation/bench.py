"""`mirror-rt bench`: every method (a runner: `answer(messages, config) -> (text, new_tokens, wall, accept_lengths,
stats)`) on the same questions, in a rotating order per question so machine drift hits all alike; a multi-turn
question carries the method's own answers. With repeats a turn keeps the median wall time and the first run's text.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from mirror_rt.evaluation import report
from mirror_rt.evaluation.specbench import Answer, Question, write_answers
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.engine import GenerationError


class EngineRunner:
    """One of our modes on an `Engine`, with a thread budget for the target."""

    def __init__(self, name: str, engine, mode: str, threads: int | None = None, **options):
        self.name, self.engine, self.mode, self.threads, self.options = name, engine, mode, threads, options
        self.label = describe(engine.names, mode)  # path and precision, for the report
        self.precision = engine.names.get("target_precision", "fp32")  # compared within this precision
        self.target = f"{engine.names.get('path', 'engine')}, {self.precision}"  # the very target it runs
        self.target_only = mode == "ar"

    def answer(self, messages: list[dict], config: GenerationConfig):
        target = self.engine.target
        previous = target.set_threads(self.threads) if self.threads and target.capabilities.threads else None
        try:
            gen = self.engine.generate(messages, replace(config, mode=self.mode, **self.options))
        finally:
            if previous is not None:
                target.set_threads(previous)
        s = gen.stats
        return gen.text, s["new_tokens"], s["wall_time_s"], s.get("accept_lengths", []), s


class ReplayRunner(EngineRunner):
    """A replay row (evaluation.replay): before each answer, the prompt's greedy `ar` text is recorded once (untimed)
    and set as what the engine's replay draft proposes, each token kept with probability `alpha`."""

    def __init__(self, name: str, engine, mode: str, alpha: float, recordings):
        super().__init__(name, engine, mode)
        self.alpha, self.recordings = alpha, recordings
        self.label += f"; proposals replayed: the target's greedy text, each token kept with probability {alpha:g}"

    def answer(self, messages: list[dict], config: GenerationConfig):
        from mirror_rt.evaluation.replay import replay_of

        prompt = self.engine.prompt_ids(messages)
        continuation = self.recordings.continuation(prompt, config)
        draft = self.engine.draft
        draft.replay = replay_of(prompt, continuation, self.alpha, config.seed, draft.vocab_size)
        try:
            return super().answer(prompt, config)
        finally:
            draft.replay = None


def replay_runners(methods: list[str], engine, mode: str) -> list:
    """The `<mode>-replay[:alpha]` rows of `methods` over `engine`'s target and draft: a replay engine each (its own
    decoder: no row's load policy or prefix cache carries into another's), recordings made once by a recorder of
    their own."""
    from mirror_rt.evaluation.replay import Recordings, replay_engine, replay_method

    rows = [(m, replay_method(m)) for m in methods]
    rows = [(m, parsed[1]) for m, parsed in rows if parsed is not None and parsed[0] == mode]
    if not rows:
        return []
    recordings = Recordings(replay_engine(engine, draft=False))
    return [ReplayRunner(m, replay_engine(engine), mode, alpha, recordings) for m, alpha in rows]


def describe(names: dict, mode: str) -> str:
    """`onnx bundle; target fp32 weights/compute/KV; draft ...`: an engine's path and each role's precisions."""
    target = names.get("target_precision", "?")
    line = f"{names.get('path', 'engine')}; target {precision_triplet(target)}"
    return line if mode == "ar" else f"{line}; draft {precision_triplet(names.get('draft_precision', target))}"


# weights / compute / KV of each ONNX weight precision (exporters.onnx): quantized products also quantize activations
QUANTIZED = {"int8": "int8 weights, int8 activations (per row and block of 32), fp32 KV",
             "int4": "int4 weights (head int8), int8 activations (per row and block of 32), fp32 KV",
             "q4_1": "q4_1 weights (head int8), int8 activations (per row and block of 32), fp32 KV",
             "w8a8": "int8 weights (per column), int8 activations (per row), fp32 KV",
             # bundles written one tensor at a time (exporters.stream_export): mirror-rt's own products, fp16 KV
             "gguf": "the GGUF's own blocks, int8 activations (per block of 32; 256 for k-quants), fp16 KV",
             "q8_0": "q8_0 weights (blocks of 32), int8 activations (per block of 32), fp16 KV",
             "q4_0": "q4_0 weights (blocks of 32), int8 activations (per block of 32), fp16 KV",
             "f16": "f16 weights, fp32 activations, fp16 KV"}


def precision_triplet(precision: str) -> str:
    """Weights / compute / KV of a role from its weight precision."""
    if precision in ("fp32", "bf16", "fp16", "fp64"):
        return f"{precision} weights/compute/KV"
    return QUANTIZED.get(precision, f"{precision} weights, fp32 activations/KV")


def report_row(runner) -> report.Row:
    """What the report needs of a runner: its label, precision, and whether it is a target-only row of ours."""
    return report.Row(label=getattr(runner, "label", ""), precision=getattr(runner, "precision", "fp32"),
                      target_only=getattr(runner, "target_only", False), ours=isinstance(runner, EngineRunner),
                      target=getattr(runner, "target", ""), replayed=getattr(runner, "alpha", None))


@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs."""

    config: GenerationConfig  # max_new_tokens, sampling, gamma...
    repeats: int = 1
    warmup_tokens: int = 16


def run_bench(runners: list, questions: list[Question], settings: BenchConfig, progress=True,
              log=print) -> dict[str, list[Answer]]:
    """Answers per method, interleaved question by question; a question one method cannot serve is skipped for all.
    A peer whose process dies (peer_process.PeerCrashed) gets `skipped` (why) and no answers; the rest go on."""
    from tqdm import tqdm

    warmup = replace(settings.config, max_new_tokens=settings.warmup_tokens)
    for runner in [r for r in runners if not _skipped(r)]:  # warm-up: first-call costs stay out of the figures
        _unless_crashed(runner, lambda r=runner: r.answer([{"role": "user", "content": "Hello"}], warmup), log)
    answers: dict[str, list[Answer]] = {r.name: [] for r in runners if not _skipped(r)}
    total = len(questions) * len(answers)
    with tqdm(total=total, desc="bench", unit="answer", disable=not progress) as bar:
        for i, question in enumerate(questions):
            order = runners[i % len(runners):] + runners[:i % len(runners)]
            try:
                done = {r.name: _unless_crashed(r, lambda r=r, q=question: _answer_question(r, q, settings), log)
                        for r in order if not _skipped(r)}
            except GenerationError as exc:
                with bar.external_write_mode(file=sys.stderr):  # on a line of its own, not under the bar's redraw
                    log(f"bench: skipping question {question.question_id}: {exc}")
                done = {}
            for name, answer in done.items():
                if answer is not None:
                    answers[name].append(answer)
            bar.update(len(done) or len(answers))
    for runner in filter(_skipped, runners):  # a row with some questions only would not compare
        answers.pop(runner.name, None)
    if questions and not any(answers.values()):  # a report of zeros would read as a measurement
        raise GenerationError(f"no question could be answered ({len(questions)} skipped): nothing was measured")
    return answers


def _skipped(runner) -> bool:
    return bool(getattr(runner, "skipped", None))


def _unless_crashed(runner, call, log):
    """`call()`; when the runner's process dies, the runner is marked skipped (with why) and None returned."""
    from mirror_rt.evaluation.peer_process import PeerCrashed

    try:
        return call()
    except PeerCrashed as exc:
        runner.skipped = f"{exc} while answering"
        log(f"bench: skipping {runner.name}: {runner.skipped}")
        return None


def _answer_question(runner, question: Question, settings: BenchConfig) -> Answer:
    answer = Answer(question.question_id, question.category, runner.name)
    messages: list[dict] = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        runs = [runner.answer(list(messages), settings.config) for _ in range(settings.repeats)]
        text, new_tokens, _, accept_lengths, stats = runs[0]
        answer.turns.append(text)
        answer.new_tokens.append(new_tokens)
        answer.wall_time.append(statistics.median(r[2] for r in runs))
        answer.accept_lengths.append(list(accept_lengths))
        answer.stats.append({k: v for k, v in stats.items() if k != "accept_lengths"})
        messages.append({"role": "assistant", "content": text})
    return answer


def write_results(out_dir: Path, answers: dict[str, list[Answer]], rows: dict[str, report.Row], command: str,
                  greedy: bool = True, skipped: dict[str, str] | None = None) -> dict:
    """Answer files, summary.json, report.md and speedup.png (evaluation.report); returns the summary. `rows`: per
    method, what `report_row` says of its runner."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "answers").mkdir(exist_ok=True)
    for stale in (out_dir / "answers").glob("*.jsonl"):  # an earlier run's methods: not this report's
        stale.unlink()
    for method, items in answers.items():
        write_answers(out_dir / "answers" / f"{method}.jsonl", items)
    base, fastest = report.baselines(answers, rows)
    refs = report.references(answers, rows) if greedy else {}
    summary = report.summarize(answers, base, rows, fastest)
    mismatches = report.count_mismatches(answers, refs) if refs else {}
    methods, labels = list(answers), {m: rows[m].label if m in rows else "" for m in answers}
    doc = {"command": command, "baselines": base, "fastest_target_only": fastest, "references": refs,
           "paths": labels, "precisions": {m: rows[m].precision for m in answers if m in rows}, "summary": summary,
           "mismatches": {m: len(v) for m, v in mismatches.items()},
           "mismatch_list": {m: v for m, v in mismatches.items() if v}, "skipped": skipped or {},
           "replayed": {m: rows[m].replayed for m in answers if m in rows and rows[m].replayed is not None}}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2))
    if any(rows[m].target_only for m in answers if m in rows):
        baseline = ("Speedup 1.0 per precision (fastest target-only row): " +
                    ", ".join(f"{p} `{m}`" for p, m in base.items()) + f"; fastest target-only overall: `{fastest}` "
                    "(column 'vs fastest')")
    else:
        baseline = (f"No target-only row ran (add `ar` to --methods): speedups are against `{fastest}`, not a "
                    "baseline, and no greedy text was compared")
    lines = [f"Command: `{command}`", "", baseline, "", report.markdown_table(summary, methods, labels)]
    lines += [note for note in (report.decode_note(summary, methods), report.replay_note(rows, methods)) if note]
    if refs:
        lines.append("Greedy output mismatches against our target-only row over the same target (else of the same "
                     "precision): " + ", ".join(f"{m} {len(v)} (vs `{refs[m]}`)" for m, v in mismatches.items()) +
                     ". Our speculative rows must have none against their own target, at every precision; "
                     "another precision, or a compiled target against an eager one, may round differently.\n")
    lines += [f"Skipped row `{m}`: {why}" for m, why in (skipped or {}).items()]  # a peer's process died
    (out_dir / "report.md").write_text("\n".join(lines))
    report.write_chart(summary, methods, out_dir / "speedup.png")
    return doc


def format_profile(answers) -> str:
    """Mirror's mean time per phase per step over all turns."""
    phases: dict[str, list[float]] = {}
    for a in answers:
        for s in a.stats:
            for k, v in s.get("phase_ms_per_step", {}).items():
                phases.setdefault(k, []).append(v)
    return "mirror, ms per step (mean over turns): " + ", ".join(
        f"{k} {sum(v) / len(v):.1f}" for k, v in phases.items())
