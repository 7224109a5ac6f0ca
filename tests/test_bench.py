"""Bench: SpecBench formats, speedup arithmetic, a smoke run, the chart."""

import json
import subprocess
import sys

import pytest

from mirror_rt.evaluation import report
from mirror_rt.evaluation.specbench import (
    Answer,
    DataError,
    pick_evenly,
    read_answers,
    read_questions,
    write_answers,
)


def write_questions(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_question_file_round_trip_and_even_pick(tmp_path):
    rows = [{"question_id": i, "category": "ab"[i % 2] if i < 6 else "c", "turns": [f"q{i}"]} for i in range(8)]
    qs = read_questions(write_questions(tmp_path / "q.jsonl", rows))
    assert [q.question_id for q in pick_evenly(qs, 4)] == [0, 1, 6, 2]  # a, b, c, then a again
    assert [q.question_id for q in read_questions(tmp_path / "q.jsonl", ["c"])] == [6, 7]


def test_bad_question_file_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question_id": 1, "category": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        read_questions(path)
    with pytest.raises(DataError, match="not found"):
        read_questions(tmp_path / "missing.jsonl")
    binary = tmp_path / "binary.jsonl"  # was codecs' message, without the file
    binary.write_bytes(b'{"question_id": 1, "category": "x", "turns": ["\xff"]}\n')
    with pytest.raises(DataError, match=r"binary.jsonl: not UTF-8 text \(byte 0xff at offset 47\)"):
        read_questions(binary)
    twice = write_questions(tmp_path / "twice.jsonl", [{"question_id": 7, "category": "x", "turns": [t]} for t in "ab"])
    with pytest.raises(DataError, match=r"twice.jsonl:2: question_id 7 again \(first at line 1\)"):
        read_questions(twice)  # answers and reports are keyed by the id: the second overwrote the first


def test_answer_file_round_trip(tmp_path):
    a = Answer(7, "math", "mirror", ["x", "y"], [10, 20], [0.5, 1.0], [[2, 3], [1]], [{"reuse_hit_rate": 0.5}])
    write_answers(tmp_path / "a.jsonl", [a])
    (b,) = read_answers(tmp_path / "a.jsonl")
    assert (b.question_id, b.turns, b.new_tokens, b.wall_time, b.accept_lengths) == (
        7, ["x", "y"], [10, 20], [0.5, 1.0], [[2, 3], [1]])


def test_speedup_as_specbench_computes_it():
    """Per question tokens/s, mean over questions, ratio of means (hand-computed)."""
    base = [Answer(1, "m", "ar", new_tokens=[10], wall_time=[1.0]),
            Answer(2, "m", "ar", new_tokens=[30], wall_time=[1.0])]
    fast = [Answer(1, "m", "sd", new_tokens=[10], wall_time=[0.5], accept_lengths=[[2, 3]]),
            Answer(2, "m", "sd", new_tokens=[30], wall_time=[0.5], accept_lengths=[[5]])]
    summary = report.summarize({"ar": base, "sd": fast}, "ar")
    # ar: (10 + 30) / 2 = 20 tok/s; sd: (20 + 60) / 2 = 40 tok/s -> 2.0x; accepted (2+3+5)/3
    assert summary["overall"]["sd"]["tokens_per_s"] == 40.0 and summary["overall"]["sd"]["speedup"] == 2.0
    assert summary["overall"]["sd"]["mean_accepted_length"] == pytest.approx(10 / 3, abs=1e-3)


def test_multi_turn_speed_uses_all_turns():
    a = Answer(1, "m", "x", new_tokens=[10, 30], wall_time=[1.0, 3.0])
    assert report.question_speed(a) == 10.0


def test_mismatches_counted():
    ar = [Answer(1, "m", "ar", turns=["a", "b"])]
    sd = [Answer(1, "m", "sd", turns=["a", "c"])]
    assert report.count_mismatches({"ar": ar, "sd": sd}, "ar") == {"sd": [(1, 1)]}


def test_smoke_run_writes_everything(tmp_path):
    """A 2-question run of the methods available in CI: answers, summary, report, a valid PNG."""
    data = write_questions(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "a", "turns": ["hello there", "and again"]},
        {"question_id": 2, "category": "b", "turns": ["count to ten"]}])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", "tiny",
                           "--methods", "ar,sd,mirror,ov-genai-sd", "--max-new-tokens", "12", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipping ov-genai-sd" in proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["mismatches"] == {"ar-torch-2t": 0, "sd": 0, "mirror": 0} or doc["mismatches"] == {"sd": 0, "mirror": 0}
    assert set(doc["summary"]) == {"a", "b", "overall"}
    assert len(read_answers(out / "answers" / "mirror.jsonl")) == 2
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| overall | mirror |" in (out / "report.md").read_text()


def bench_cli(*args, model: str | None = "tiny") -> subprocess.CompletedProcess:
    named = ["--model", model] if model else []
    return subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", *named, "--max-new-tokens", "4", *args],
                          capture_output=True, text=True, timeout=300)


def test_skipped_questions_are_said_and_a_run_of_none_is_an_error(tmp_path):
    """A question whose second turn overflows the context is skipped with a line (it was dropped silently under the
    bar's redraw), and a run that answered nothing is an error, not a report of zeros with exit 0."""
    long = "y" * 300  # beyond the tiny model's 256 positions
    data = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "a", "turns": ["hi", long]},
                                                  {"question_id": 2, "category": "a", "turns": ["hello"]}])
    proc = bench_cli("--data", str(data), "--methods", "ar", "--out", str(tmp_path / "one"))
    assert proc.returncode == 0, proc.stderr
    assert "bench: skipping question 1: prompt too long" in proc.stderr
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["summary"]["overall"]["ar-torch-1t"][
        "questions"] == 1
    data = write_questions(tmp_path / "none.jsonl", [{"question_id": 1, "category": "a", "turns": ["hi", long]}])
    proc = bench_cli("--data", str(data), "--methods", "ar", "--out", str(tmp_path / "none"))
    assert proc.returncode == 2 and "no question could be answered (1 skipped): nothing was measured" in proc.stderr
    assert not (tmp_path / "none" / "report.md").exists()


def test_a_rerun_into_the_same_folder_keeps_only_its_own_answers_and_says_when_no_baseline_ran(tmp_path):
    data = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "a", "turns": ["hello"]}])
    out = tmp_path / "out"
    assert bench_cli("--data", str(data), "--methods", "sd", "--out", str(out)).returncode == 0
    assert "No target-only row ran (add `ar` to --methods)" in (out / "report.md").read_text()  # 'sd 1.00x vs sd'
    assert bench_cli("--data", str(data), "--methods", "ar", "--out", str(out)).returncode == 0
    assert sorted(f.name for f in (out / "answers").iterdir()) == ["ar-torch-1t.jsonl", "ar-torch-2t.jsonl"]


def test_rows_that_would_run_another_model_than_the_one_named_are_skipped_with_a_line(tmp_path):
    """Beside --bundle (no --model) a precision row or a peer ran the default model unsaid; with --model tiny a
    precision row ran the tiny model labelled as OpenVINO GenAI at bf16; --bundle with --torch ran the bundle."""
    from mirror_rt.exporters.export import export_bundle

    bundle = export_bundle("tiny", tmp_path / "bundle", progress=False)
    data = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "a", "turns": ["hello"]}])
    proc = bench_cli("--data", str(data), "--bundle", str(bundle), "--methods", "ar,ar-int8,ov-genai", "--out",
                     str(tmp_path / "b"), model=None)
    assert proc.returncode == 0, proc.stderr
    assert "bench: skipping ar-int8, ov-genai: beside --bundle they would run the default model" in proc.stderr
    assert all(m.startswith("ar-") and "int8" not in m
               for m in json.loads((tmp_path / "b" / "summary.json").read_text())["paths"])
    proc = bench_cli("--data", str(data), "--methods", "ar,ar-int8", "--out", str(tmp_path / "m"))
    assert proc.returncode == 0 and "bench: skipping ar-int8: precision rows run the default model's" in proc.stderr
    assert not any("genai" in path for path in json.loads((tmp_path / "m" / "summary.json").read_text())["paths"
                                                                                                         ].values())
    proc = bench_cli("--data", str(data), "--bundle", str(bundle), "--torch", "--methods", "ar", "--out",
                     str(tmp_path / "t"), model=None)
    assert proc.returncode == 2 and "a bundle runs as exported: --torch runs torch eager" in proc.stderr


def test_hf_assisted_smoke(tmp_path):
    """transformers' assisted generation on a tiny HF folder: runs and matches our greedy ar."""
    from conftest import write_hf_folder

    folder = write_hf_folder(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "a", "turns": ["w5 w6 w7"]},
                                                 {"question_id": 2, "category": "b", "turns": ["w9 w3"]}])
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", str(folder),
                           "--methods", "ar,hf-assisted", "--max-new-tokens", "8", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert doc["summary"]["overall"]["hf-assisted"]["questions"] == 2
    assert "hf-assisted" in doc["mismatches"]  # counted and reported, whatever the number


def _answers(method, speed, text="t"):
    return [Answer(1, "m", method, turns=[text], new_tokens=[int(speed)], wall_time=[1.0])]


PRECISION_ROWS = {
    "ar-ort-2t": report.Row("onnx", "fp32", target_only=True, ours=True),
    "ov-genai-f32": report.Row("genai f32", "fp32", target_only=True),
    "ar-bf16-2t": report.Row("torch bf16", "bf16", target_only=True, ours=True),
    "ov-genai": report.Row("genai bf16", "bf16", target_only=True),
    "mirror": report.Row("onnx mirror", "fp32", ours=True),
    "mirror-bf16": report.Row("torch bf16 mirror", "bf16", ours=True),
}


def test_speedup_against_the_fastest_target_only_row_of_the_same_precision():
    """fp32 rows against GenAI f32 (faster than our ar), bf16 rows against GenAI bf16; both against the fastest."""
    speeds = {"ar-ort-2t": 10, "ov-genai-f32": 15, "ar-bf16-2t": 20, "ov-genai": 25, "mirror": 30, "mirror-bf16": 40}
    answers = {m: _answers(m, s) for m, s in speeds.items()}
    base, fastest = report.baselines(answers, PRECISION_ROWS)
    assert base == {"fp32": "ov-genai-f32", "bf16": "ov-genai"} and fastest == "ov-genai"
    overall = report.summarize(answers, base, PRECISION_ROWS, fastest)["overall"]
    assert overall["mirror"]["speedup"] == 2.0 and overall["mirror"]["speedup_vs_fastest"] == 1.2
    assert overall["mirror-bf16"]["speedup"] == 1.6 and overall["mirror-bf16"]["baseline"] == "ov-genai"


def test_greedy_text_is_compared_within_a_precision():
    refs = report.references({m: [] for m in PRECISION_ROWS}, PRECISION_ROWS)
    assert refs["mirror"] == refs["ov-genai-f32"] == "ar-ort-2t"
    assert refs["mirror-bf16"] == refs["ov-genai"] == "ar-bf16-2t" and "ar-ort-2t" not in refs
    assert refs["ar-bf16-2t"] == "ar-ort-2t"  # what bf16 changes against fp32
    answers = {"ar-ort-2t": _answers("ar-ort-2t", 10, "a"), "mirror": _answers("mirror", 20, "a"),
               "ar-bf16-2t": _answers("ar-bf16-2t", 10, "b"), "mirror-bf16": _answers("mirror-bf16", 20, "b")}
    counts = report.count_mismatches(answers, report.references(answers, PRECISION_ROWS))
    assert counts == {"mirror": [], "ar-bf16-2t": [(1, 0)], "mirror-bf16": []}  # bf16 vs fp32 only for ar-bf16


def test_speculative_rows_are_compared_with_ar_over_the_very_same_target():
    """A compiled bf16 target rounds differently from the eager one: mirror over it is compared with ar over it,
    the compiled ar with the eager ar (what compiling changes), and only the first pair must agree."""
    rows = {"ar-bf16-1t": report.Row("t", "bf16", target_only=True, ours=True, target="torch eager, bf16"),
            "ar-bf16-compiled-1t": report.Row("t", "bf16", target_only=True, ours=True,
                                              target="torch compiled, bf16"),
            "mirror-bf16": report.Row("t", "bf16", ours=True, target="torch eager, bf16"),
            "mirror-bf16-compiled": report.Row("t", "bf16", ours=True, target="torch compiled, bf16")}
    refs = report.references({m: [] for m in rows}, rows)
    assert refs == {"ar-bf16-compiled-1t": "ar-bf16-1t", "mirror-bf16": "ar-bf16-1t",
                    "mirror-bf16-compiled": "ar-bf16-compiled-1t"}
    assert report.same_target(rows, "mirror-bf16-compiled", "ar-bf16-compiled-1t")
    assert not report.same_target(rows, "ar-bf16-compiled-1t", "ar-bf16-1t")


def test_report_names_both_baselines_and_every_precision(tmp_path):
    from mirror_rt.evaluation.bench import write_results

    answers = {m: _answers(m, s) for m, s in {"ar-ort-2t": 10, "ov-genai": 25, "mirror": 30}.items()}
    rows = {m: PRECISION_ROWS[m] for m in answers}
    doc = write_results(tmp_path, answers, rows, "mirror-rt bench ...")
    text = (tmp_path / "report.md").read_text()
    assert "fp32 `ar-ort-2t`, bf16 `ov-genai`; fastest target-only overall: `ov-genai`" in text
    assert "| overall | mirror | onnx mirror | 1 | 30.0 | 3.00x | 1.20x |" in text
    assert doc["precisions"]["ov-genai"] == "bf16" and doc["baselines"] == {"fp32": "ar-ort-2t", "bf16": "ov-genai"}


def test_every_row_names_weights_compute_and_kv():
    from types import SimpleNamespace

    from mirror_rt.evaluation.bench import EngineRunner
    from mirror_rt.evaluation.bench_methods import OVGenAIRunner

    engine = SimpleNamespace(names={"path": "onnx bundle", "target_precision": "fp32", "draft_precision": "q4_1"})
    mirror = EngineRunner("mirror", engine, "mirror")
    assert mirror.label == ("onnx bundle; target fp32 weights/compute/KV; draft q4_1 weights (head int8), int8 "
                            "activations (per row and block of 32), fp32 KV")
    assert (mirror.precision, mirror.target_only) == ("fp32", False)
    stats = {"weights": "fp32 target", "inference_precision": "bf16", "kv_cache_precision": "u8"}
    genai = OVGenAIRunner("ov-genai", None, None, False, stats)
    assert genai.label == "openvino genai; fp32 target weights, bf16 compute, u8 KV"
    assert (genai.precision, genai.target_only) == ("bf16", True)
    f32 = OVGenAIRunner("ov-genai-f32", None, None, False, stats | {"inference_precision": "f32"})
    assert f32.precision == "fp32"


def test_compiled_bf16_rows_run_beside_the_eager_ones(monkeypatch):
    """`-compiled` rows load their own compiled engine; the plain rows stay eager unless --compile."""
    from mirror_rt.devices import torch_engine
    from mirror_rt.devices.options import EngineConfig
    from mirror_rt.evaluation.bench_engines import bf16_runners

    loaded, real_load_torch = [], torch_engine.load_torch

    def fake_load_torch(options, mode=None, log=None):  # records the settings, loads the tiny preset eagerly
        draft = options.models.draft_model
        loaded.append((draft, options.precision.compile, options.precision.dtype))
        tiny = EngineConfig.from_flags(model="tiny", draft_model=draft or "target")
        return real_load_torch(tiny, mode, log=lambda *_: None)

    monkeypatch.setattr(torch_engine, "load_torch", fake_load_torch)
    methods = ["ar-bf16", "mirror-bf16", "ar-bf16-compiled", "mirror-bf16-compiled"]
    runners = bf16_runners(methods, None, None, "target", compile=False, cache_dir=None, log=lambda *_: None)
    names = [r.name for r in runners]
    assert "mirror-bf16" in names and "mirror-bf16-compiled" in names
    assert {n for n in names if n.startswith("ar-bf16-compiled-")} and {n for n in names if n.startswith("ar-bf16-1")}
    assert [c for _, c, _ in loaded] == [False, False, True, True] and {d for *_, d in loaded} == {"bfloat16"}
    loaded.clear()
    bf16_runners(["ar-bf16"], None, None, None, compile=True, cache_dir=None, log=lambda *_: None)
    assert loaded[0][1] is True  # --compile compiles the plain rows too


def test_bf16_rows_run_a_torch_bf16_target(tmp_path):
    """`ar-bf16` and `mirror-bf16` beside the fp32 rows: labels, precisions, mirror-bf16 checked against ar-bf16."""
    data = write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "a", "turns": ["hello there"]}])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "bench", "--data", str(data), "--model", "tiny",
                           "--methods", "ar,mirror,ar-bf16,mirror-bf16", "--max-new-tokens", "12", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    doc = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stderr  # bf16 rows may part at near-ties: reported, not failed
    assert doc["precisions"]["mirror-bf16"] == "bf16" and doc["references"]["mirror-bf16"] == "ar-bf16-1t"
    assert doc["baselines"]["bf16"].startswith("ar-bf16-") and "bf16 weights/compute/KV" in doc["paths"]["mirror-bf16"]


def test_precision_rows_run_the_default_bundle_at_that_precision(tmp_path, monkeypatch):
    """`ar-int8` and `mirror-int8` run the default model's bundle with an int8 target (named for it, compared with
    each other); another model's precision rows are skipped with a line."""
    from mirror_rt.devices import engines
    from mirror_rt.evaluation.bench_engines import precision_runners
    from mirror_rt.exporters.export import export_bundle

    asked = []

    def fake_default_bundle(cache_dir=None, progress=True, log=None, weights=None):  # the tiny model stands in
        asked.append(weights)
        return export_bundle("tiny", tmp_path / f"b-{weights}", progress=False, weights=weights, kappa=2)

    monkeypatch.setattr(engines, "default_bundle", fake_default_bundle)
    lines = []
    runners = precision_runners(["ar-int8", "mirror-int8", "mirror"], None, None, lines.append)
    assert asked == ["int8"] and [r.name for r in runners][-1] == "mirror-int8"
    assert {r.name for r in runners} >= {"ar-int8-1t", "mirror-int8"}
    assert {r.precision for r in runners} == {"int8"}
    assert "int8 activations" in runners[-1].label
    assert precision_runners(["ar-q4_1"], "some/other-model", None, lines.append) == []
    assert "skipping ar-q4_1" in lines[-1]


def test_decode_speed_leaves_the_prompts_reading_out_and_is_said_under_the_table(tmp_path):
    """32 new tokens after a 6 s prompt: tokens/s says 2.9x where decoding is 8x; the decode line says both rows'."""
    from mirror_rt.evaluation.bench import write_results

    rows = {"ar-ort-2t": report.Row("onnx", "fp32", target_only=True, ours=True),
            "mirror": report.Row("onnx mirror", "fp32", ours=True)}

    def answer(method, wall):
        return Answer(1, "qa", method, turns=["t"], new_tokens=[33], wall_time=[wall],
                      stats=[{"time_to_first_token_s": 6.0}])

    answers = {"ar-ort-2t": [answer("ar-ort-2t", 6.0 + 32 / 2)], "mirror": [answer("mirror", 6.0 + 32 / 16)]}
    doc = write_results(tmp_path, answers, rows, "cmd")
    overall = doc["summary"]["overall"]
    assert overall["ar-ort-2t"]["decode_tokens_per_s"] == 2.0 and overall["mirror"]["decode_tokens_per_s"] == 16.0
    assert overall["mirror"]["speedup"] == pytest.approx(22 / 8, abs=1e-3)
    line = next(x for x in (tmp_path / "report.md").read_text().splitlines() if x.startswith("Decode only"))
    assert "`ar-ort-2t` 2.00 (1.00x)" in line and "`mirror` 16.00 (8.00x)" in line
    assert report.decode_speed([Answer(1, "qa", "peer", turns=["t"], new_tokens=[5], wall_time=[1.0])]) is None
