"""The CLI through a subprocess: text on stdout, one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from conftest import write_hf_folder


def run_cli(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "mirror_rt.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def assert_one_line_error(proc, pattern):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if "mirror-rt" in line and "error" in line]
    assert lines and pattern in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_preset_sd_equals_ar_json():
    out = {}
    for mode in ("ar", "sd"):
        proc = run_cli("run", "hello", "--model", "tiny", "--mode", mode, "--max-new-tokens", "20", "--json")
        assert proc.returncode == 0, proc.stderr
        out[mode] = json.loads(proc.stdout)
    assert out["sd"]["text"] == out["ar"]["text"]
    assert out["sd"]["stats"]["mean_accepted_length"] > 1.0


def test_prompt_from_stdin():
    proc = run_cli("run", "--model", "tiny", "--max-new-tokens", "5", "--json", stdin="hello")
    assert proc.returncode == 0 and json.loads(proc.stdout)["stats"]["prompt_tokens"] == 5


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "model not found: /no/such/model"),
    (["--mode", "fast"], "unknown mode 'fast'"),
    (["--branch-budget", "-1"], "must be >= 0"),
    (["--draft-lookup", "-2"], "must be >= 0, got -2"),
    (["--temperature", "-1"], "--temperature must be"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
])
def test_bad_input_one_line_error(args, message):
    assert_one_line_error(run_cli("run", "hi", "--model", "tiny", *args), message)


def test_invalid_number_refused():
    proc = run_cli("run", "hi", "--model", "tiny", "--max-new-tokens", "many")
    assert proc.returncode == 2 and "expected a whole number, got 'many'" in proc.stderr


def test_prompt_too_long():
    assert_one_line_error(run_cli("run", "y" * 400, "--model", "tiny"), "prompt too long")


def test_unsupported_architecture(tmp_path):
    folder = write_hf_folder(tmp_path / "gpt", model_type="gpt2")
    assert_one_line_error(run_cli("run", "hi", "--model", str(folder)), "unsupported architecture 'gpt2'")


def test_vocabulary_mismatch(tmp_path):
    t, d = write_hf_folder(tmp_path / "t", 64), write_hf_folder(tmp_path / "d", 70)
    assert_one_line_error(run_cli("run", "w3", "--model", str(t), "--draft-model", str(d)),
                          "vocabulary mismatch")
