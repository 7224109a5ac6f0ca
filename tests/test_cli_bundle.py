"""CLI round trip: `mirror-rt export` then `mirror-rt run --bundle` (optimum-intel style)."""

import json
import subprocess
import sys

import pytest


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mirror_rt.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "tiny-ov"
    proc = run_cli("export", "--model", "tiny", "--format", "openvino", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "manifest.json").exists()
    return out


def test_bundle_modes_identical_through_fallback(tiny_bundle):
    """--target cuda --draft npu fall back to a CPU backend (one line each); ar, sd, mirror agree."""
    texts = {}
    for mode in ("ar", "sd", "mirror"):
        proc = run_cli("run", "hello", "--bundle", str(tiny_bundle), "--target", "cuda", "--draft", "npu",
                       "--mode", mode, "--max-new-tokens", "24", "--json")
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if line.startswith("mirror-rt: warning: device")]
        assert len(warnings) == 2 and "using" in warnings[0] and "Traceback" not in proc.stderr
        texts[mode] = json.loads(proc.stdout)["text"]
    assert texts["sd"] == texts["ar"] == texts["mirror"]


def test_strict_devices_fails(tiny_bundle):
    proc = run_cli("run", "hi", "--bundle", str(tiny_bundle), "--target", "npu", "--strict-devices")
    assert proc.returncode == 2 and "mirror-rt: error: device 'npu'" in proc.stderr


def test_corrupt_bundle_file_named(tiny_bundle, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_bundle, broken)
    (broken / "draft.bin").write_bytes(b"garbage")
    proc = run_cli("run", "hi", "--bundle", str(broken))
    assert proc.returncode == 2 and "draft.bin" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,named", [(["--exit-layer", "99"], "--exit-layer"), (["--kv", "mine"], "--kv must be"),
                                        (["--format", "openvino", "--kv", "shared"], "--kv shared needs --format onnx"),
                                        (["--format", "torch", "--draft-weights", "q4_1"], "q4_1 needs --format onnx"),
                                        # written as fp32 with a warning, run as fp32 under the int8 name
                                        (["--format", "torch", "--weights", "int8"], "int8 needs --format onnx or "
                                                                                     "openvino"),
                                        (["--format", "torch", "--draft-weights", "int4"], "int4 needs --format onnx"),
                                        (["--weights", "fp16"], "fp16 needs --format openvino or torch")])
def test_export_bad_option_named(tmp_path, args, named):
    proc = run_cli("export", "--model", "tiny", *args, "--out", str(tmp_path / "x"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mirror-rt: error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and named in errors[0]  # on a line of its own, after the bar


@pytest.mark.parametrize("args, says", [(["--check", "--out", "FOLDER"], "it is a folder, a file is needed"),
                                        (["--check", "--max-new-tokens", "99999"], "must be at most 1024"),
                                        (["--out", "x.json"], "--out: only with --check"),
                                        (["--models", ""], "--models: only with --check"),
                                        (["--check", "--models", ""], "--models takes presets"),
                                        (["--check", "--models", "smollm2-135m,"], "--models takes presets")])
def test_devices_check_options_refused_before_the_check(tmp_path, args, says):
    """A folder as --out failed after the whole check had run; a huge token count ran on and on; an empty
    --models ran the default models."""
    proc = run_cli("devices", *[str(tmp_path) if a == "FOLDER" else a for a in args])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("mirror-rt: error: ")
    assert says in lines[0] and not proc.stdout


def test_devices_lists_backends():
    proc = run_cli("devices")
    assert proc.returncode == 0 and "torch:cpu" in proc.stdout and "openvino:CPU" in proc.stdout


def test_bench_over_bundle(tiny_bundle, tmp_path):
    """ar on every backend/thread count of the bundle, sd, mirror and its no-lookup ablation: no mismatch."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["hello"]}) + "\n")
    proc = run_cli("bench", "--data", str(data), "--bundle", str(tiny_bundle), "--methods",
                   "ar,sd,mirror,mirror-no-lookup", "--max-new-tokens", "16", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert doc["baselines"]["fp32"].startswith("ar-ov-") and set(doc["mismatches"].values()) == {0}
    assert {"sd", "mirror", "mirror-no-lookup"} <= set(doc["summary"]["overall"])


def test_stats_report_the_load_time(tiny_bundle):
    """run --json and --stats say how long the engine took to load (the bundle's sessions and tokenizer)."""
    proc = run_cli("run", "hello", "--bundle", str(tiny_bundle), "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    assert 0 < json.loads(proc.stdout)["stats"]["load_time_s"] < 600
    proc = run_cli("run", "hello", "--bundle", str(tiny_bundle), "--max-new-tokens", "4", "--stats")
    assert proc.returncode == 0 and "load: " in proc.stderr and " s (engine ready" in proc.stderr


def test_stats_say_why_steps_ran_target_only(tiny_bundle):
    """run --stats says why steps of a speculative mode ran target-only; mode ar (target-only as asked) does not."""
    asked = ("run", "hello", "--bundle", str(tiny_bundle), "--max-new-tokens", "4", "--stats", "--mode")
    mirror = run_cli(*asked, "mirror")
    assert mirror.returncode == 0, mirror.stderr
    assert "no speculation: too few tokens were left for speculation to pay back its start" in mirror.stderr
    ar = run_cli(*asked, "ar")
    assert ar.returncode == 0 and "mean accepted length" in ar.stderr and "speculat" not in ar.stderr
