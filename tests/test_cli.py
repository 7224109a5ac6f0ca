"""The CLI through a subprocess: text on stdout, one-line errors with exit code 2."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


@pytest.mark.parametrize("stdin", ["hello", "hello\n", "hello\r\n", "\ufeffhello\n"])
def test_prompt_from_stdin(stdin):
    """`echo hello | mirror-rt run` is `mirror-rt run hello`: the line end that ends it and a byte-order mark were
    read as part of the prompt (another text)."""
    proc = run_cli("run", "--model", "tiny", "--max-new-tokens", "5", "--json", "--no-chat", stdin=stdin)
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


def _record_engine_choices(monkeypatch) -> list:
    """Replace the three engine loaders by recorders; returns the list of (loader, argument) calls."""
    from mirror_rt.devices import engines

    calls = []
    monkeypatch.setattr(engines, "default_bundle", lambda cache=None, log=None: calls.append(("default", cache))
                        or "/bundle")
    monkeypatch.setattr(engines, "load_bundle", lambda options, mode=None: calls.append(
        ("bundle", options.models.bundle)) or SimpleNamespace(names={}))
    monkeypatch.setattr(engines, "load_torch", lambda options, mode=None, log=None: calls.append(("torch", options))
                        or SimpleNamespace(names={}))
    return calls


def _run_choice(calls, argv) -> list:
    from mirror_rt.cli import dispatch as cli
    from mirror_rt.cli.options import engine_config
    from mirror_rt.devices.engines import load_engine

    args = cli.build_parser().parse_args(["run", "hi", *argv])
    calls.clear()
    load_engine(engine_config(args))
    return list(calls)


def test_default_model_runs_its_onnx_bundle(monkeypatch):
    """`run` with no model and no torch-only option takes the default model's bundle; otherwise torch."""
    calls = _record_engine_choices(monkeypatch)
    assert _run_choice(calls, ["--cache-dir", "/c"]) == [("default", "/c"), ("bundle", "/bundle")]
    assert _run_choice(calls, ["--bundle", "/b"]) == [("bundle", "/b")]
    for extra in (["--model", "tiny"], ["--torch"], ["--device", "cuda"], ["--draft-model", "target"],
                  ["--exit-layer", "3"], ["--kappa", "2"], ["--dtype", "bfloat16"], ["--threads", "1"],
                  ["--device", "cpu"], ["--dtype", "float32"], ["--kappa", "8"], ["--draft-model", "int8"]):
        assert [c[0] for c in _run_choice(calls, extra)] == ["torch"], extra  # asked for, even at a default value


def test_api_load_takes_the_same_default(monkeypatch):
    """`mirror_rt.load()` with no arguments is the default bundle; torch=True or a torch option is torch eager."""
    import mirror_rt

    calls = _record_engine_choices(monkeypatch)
    mirror_rt.load()
    assert [c[0] for c in calls] == ["default", "bundle"]
    for kwargs in ({"torch": True}, {"model": "tiny"}, {"threads": 1}):
        calls.clear()
        mirror_rt.load(**kwargs)
        assert [c[0] for c in calls] == ["torch"], kwargs


def test_bundle_with_a_torch_option_is_refused_in_one_line():
    assert_one_line_error(run_cli("run", "hi", "--bundle", "/nowhere", "--dtype", "bfloat16"),
                          "applies to torch eager only")


def test_default_bundle_falls_back_to_torch_with_a_warning(monkeypatch, capsys):
    from mirror_rt.devices import engines
    from mirror_rt.exporters.export import ExportError

    calls = _record_engine_choices(monkeypatch)

    def broken(cache=None, log=None):
        raise ExportError("no exporter here")

    monkeypatch.setattr(engines, "default_bundle", broken)
    assert [c[0] for c in _run_choice(calls, [])] == ["torch"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "no exporter here" in err[0] and "torch" in err[0]


def test_default_bundle_is_exported_once_and_never_half(tmp_path, monkeypatch):
    """An interrupted export leaves no bundle behind; a finished one is reused without exporting again."""
    import mirror_rt
    import mirror_rt.models.loading  # noqa: F401 -- bound to the real default_model_folder before it is patched
    from mirror_rt.exporters import export as export_module
    from mirror_rt.exporters.manifest import read_manifest
    from mirror_rt.models import default_model

    monkeypatch.setattr(default_model, "default_model_folder", lambda cache=None, log=None: "tiny")
    real, calls = export_module.export_bundle, []

    def interrupted(model, out, **kw):
        calls.append(model)
        out.mkdir(parents=True)
        (out / "draft.onnx").write_text("half written")
        raise KeyboardInterrupt

    def quiet(message):
        pass

    monkeypatch.setattr(export_module, "export_bundle", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mirror_rt.default_bundle(str(tmp_path), progress=False, log=quiet)
    assert not list((tmp_path / "bundles").iterdir())  # not even the half-written temporary folder

    monkeypatch.setattr(export_module, "export_bundle", lambda model, out, **kw: calls.append(model) or
                        real(model, out, kappa=2, **kw))
    folder = mirror_rt.default_bundle(str(tmp_path), progress=False, log=quiet)
    assert read_manifest(folder).n_layers > 0 and calls == ["tiny", "tiny"]
    assert mirror_rt.default_bundle(str(tmp_path), progress=False, log=quiet) == folder and len(calls) == 2
    assert [p.name for p in (tmp_path / "bundles").iterdir()] == [folder.name]
    assert read_manifest(folder).graph("target_prefix").precision == "fp32"  # the default precision
    int8 = mirror_rt.default_bundle(str(tmp_path), progress=False, log=quiet, weights="int8")  # a bench precision row
    assert int8.name == f"{folder.name}-int8" and read_manifest(int8).graph("target_prefix").precision == "int8"


def test_run_json_schema_and_regex_constrain_every_mode(tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    texts = set()
    for mode in ("ar", "sd"):
        proc = run_cli("run", "hello", "--model", "tiny", "--mode", mode, "--json-schema", str(path), "--json",
                       "--max-new-tokens", "60")
        assert proc.returncode == 0, proc.stderr
        texts.add(json.loads(proc.stdout)["text"])
    assert len(texts) == 1 and set(json.loads(texts.pop())) == {"ok", "n"}
    proc = run_cli("run", "hello", "--model", "tiny", "--regex", "[0-9]{3}-[a-z]", "--max-new-tokens", "10")
    assert proc.returncode == 0 and re.fullmatch(r"[0-9]{3}-[a-z]\n", proc.stdout), proc.stdout
    proc = run_cli("run", "hello", "--model", "tiny", "--regex", "", "--max-new-tokens", "10")  # it was dropped
    assert proc.returncode == 0 and proc.stdout == "\n", proc.stdout
    assert_one_line_error(run_cli("run", "x", "--model", "tiny", "--regex", "(["), "the grammar cannot run")
    assert_one_line_error(run_cli("run", "x", "--json-schema", str(path), "--regex", "a"),
                          "--json-schema and --regex both constrain the output")
    missing = tmp_path / "missing.json"  # it said "[Errno 2] No such file or directory", naming no flag
    assert_one_line_error(run_cli("run", "x", "--model", "tiny", "--json-schema", str(missing)),
                          f"--json-schema {missing}: No such file or directory")
    assert_one_line_error(run_cli("run", "x", "--model", "tiny", "--json-schema", str(tmp_path)),
                          f"--json-schema {tmp_path}: Is a directory")


def test_a_json_schema_file_holding_no_schema_object_is_one_line_naming_what_it_holds(tmp_path):
    """A JSON array or string is no schema (it was llguidance's 'Expecting object schema to apply options', and
    'expected value at line 1 column 1' for a string); the boolean schemas: true admits any value, false none."""
    for content, says in (("[1, 2]", "a JSON schema is an object, not a JSON array"),
                          ('"x"', "a JSON schema is an object, not a JSON string"),
                          ("false", "the JSON schema false admits no output")):
        (tmp_path / "schema.json").write_text(content)
        assert_one_line_error(run_cli("run", "x", "--model", "tiny", "--json-schema", str(tmp_path / "schema.json")),
                              says)
    (tmp_path / "schema.json").write_text("true")
    proc = run_cli("run", "x", "--model", "tiny", "--no-chat", "--json-schema", str(tmp_path / "schema.json"),
                   "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    text = json.loads(proc.stdout)["text"]
    assert text  # a prefix of some JSON value: 12 tokens may end it anywhere


@pytest.mark.parametrize("args, says", [
    (("run", "hi", "--model", "tiny", "--max-new-tokens", "0"), "argument --max-new-tokens: must be >= 1, got 0"),
    (("bench", "--limit", "0"), "argument --limit: must be >= 1, got 0"),
    (("train-draft", "--lr", "inf"), "argument --lr: must be a positive number, got 'inf'"),  # NaN streams followed
    (("export", "--model", "tiny", "--out", ""), "--out is empty: name the bundle's folder"),  # 'into .: it holds'
    (("train-draft", "--target", "tiny", "--init", "layers:x", "--data",
      str(Path(__file__).parents[1] / "evaluation" / "data" / "short-prompts.jsonl"), "--out", "/tmp/unused-ss"),
     "--init layers:K needs a whole number 1 <= K <= 4, got 'x'"),  # it was "invalid literal for int()"
    (("run", "hi", "--no-such-flag"), "unrecognized arguments: --no-such-flag"),
    (("bench", "--data", "x.jsonl", "--out", __file__), "argument --out: " + __file__ + " exists and is not a folder"),
    # a place that refuses writing: before the work, not a PermissionError traceback after it
    (("bench", "--data", "x.jsonl", "--out", "/proc/mirror-rt-bench"), "argument --out: cannot write to /proc/"),
    (("bench-serve", "--data", "x.jsonl", "--json", "/tmp"), "argument --json: cannot write to /tmp: it is a folder"),
    (("bench-serve", "--data", "x.jsonl", "--concurrency", "1,,2"), "expected comma-separated whole numbers >= 1"),
    (("run", "hi", "--model", "tiny", "--seed", str(2**64)), "--seed must be in -2**63..2**63-1"),  # it wrapped
])
def test_a_bad_argument_is_one_line_without_the_usage_block(args, says):
    proc = run_cli(*args)
    assert proc.returncode in (1, 2) and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert proc.stderr.startswith("mirror-rt") and "usage:" not in proc.stderr


@pytest.mark.parametrize("code, reraised", [(28, False), (12, False), (2, False), (5, True)])
def test_what_the_machine_refuses_is_one_line(monkeypatch, capsys, code, reraised):
    """A full disk in the middle of an export ended in torch.onnx's traceback; any command now says it in a line
    (a missing file stays the usage error it was; other OS errors are faults and keep their traceback)."""
    import os

    from mirror_rt.cli import dispatch as cli

    def full(args):
        raise OSError(code, os.strerror(code), "/tmp/bundle/target.onnx")

    monkeypatch.setitem(cli.COMMANDS, "simulate", full)
    if reraised:
        with pytest.raises(OSError):
            cli.main(["simulate"])
        return
    status = cli.main(["simulate"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mirror-rt: error: ") and "/tmp/bundle/target.onnx" in err[0]
    assert status == (2 if code == 2 else 1)


def test_a_long_prompt_shows_its_reading_and_the_same_answer(monkeypatch, capsys):
    """A prompt from PROGRESS_FROM tokens on is read under a progress bar (an 8,000-token prompt was a minute of
    silence); the answer is the same as without it."""
    from mirror_rt.cli import dispatch as cli
    from mirror_rt.cli import run as cli_run

    args = ["run", "one two three four five six seven eight nine ten " * 4, "--model", "tiny", "--no-chat",
            "--max-new-tokens", "6", "--mode", "ar"]
    monkeypatch.setattr(cli_run, "PROGRESS_FROM", 10**9)
    assert cli.main(args) == 0
    plain = capsys.readouterr()
    monkeypatch.setattr(cli_run, "PROGRESS_FROM", 8)
    assert cli.main(args) == 0
    shown = capsys.readouterr()
    assert "reading the prompt" in shown.err and "reading the prompt" not in plain.err
    assert shown.out == plain.out and plain.out.strip()


@pytest.mark.parametrize("delay", [0.12, 0.2, 0.3, 0.6])
def test_ctrl_c_at_any_moment_of_the_start_is_one_line_and_130(delay):
    """The console script (`mirror_rt.entry`) imports the CLI under a Ctrl-C guard, and the CLI parses and runs
    under its own: a SIGINT while Python imports the CLI and the engine's modules, or while `run` waits for its
    prompt on stdin, is exit 130 and one line, never a KeyboardInterrupt traceback. (Killed before Python installs
    its handler at all: the signal's default.) The prompt never comes, so no model loads; a SIGINT inside torch's
    own import is the next test's."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.entry", "run", "--model", "tiny"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if "init_import_site" in err:  # Python's own start (its site module), before any of ours: not this test's
        pytest.skip("the signal came while Python itself was starting")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == -signal.SIGINT or (proc.returncode == 130 and "mirror-rt: interrupted" in err), err


def test_sigterm_is_one_line_and_143_after_the_commands_cleanup():
    """SIGTERM raises where Ctrl-C does (`signals.Terminated`), so an export's staging folder goes as on Ctrl-C
    (it stayed: 421 MB per killed export); here `run` waits for its prompt on stdin when it comes."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.entry", "run", "--model", "tiny"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip() == "mirror-rt: terminated", (proc.returncode, err)


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`mirror-rt simulate | true`: the closed pipe was a BrokenPipeError traceback; now exit 141, nothing said."""
    proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.entry", "simulate"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_ctrl_c_inside_an_import_exits_at_once_in_one_line(tmp_path):
    """A SIGINT that lands while a module is being imported (torch and ONNX Runtime load inside commands) exits
    130 at once with one line: raised there, the KeyboardInterrupt can cross C++ frames (torch's initialisation
    calls back into Python through pybind11) and abort the process, as one CI run saw at 0.6 s. Here the module
    being imported interrupts itself, so the signal surely lands inside an import."""
    import signal

    (tmp_path / "slow_to_import.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ndeadline = time.time() + 10\n"
        "while time.time() < deadline:\n    pass\n")
    script = ("import sys, signal; from mirror_rt.cli import signals\n"
              "signal.signal(signal.SIGINT, signals.on_signal)\nimport slow_to_import\nprint('imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (done.returncode, done.stdout) == (130, ""), done
    assert done.stderr.strip() == "mirror-rt: interrupted", done.stderr


def test_a_cache_that_cannot_be_used_is_one_error_before_any_work(tmp_path):
    """`--cache-dir` a file (or a place that refuses files): one error line naming the cache, exit 2; not a warning
    that the model runs in torch instead (torch needs the same cache) followed by the error."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for cache in (afile, "/proc/mirror-rt-cache"):
        proc = run_cli("run", "hi", "--cache-dir", str(cache))
        assert_one_line_error(proc, "the model cache cannot be used")
        assert "warning" not in proc.stderr and "exporting" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, says", [
    (["bench", "--data", "x.jsonl", "--out", "o", "--mode", "ar"], "unrecognized arguments: --mode ar"),  # not --model
    (["run", "hi", "--max", "3"], "unrecognized arguments: --max 3"),
    (["bench", "--data", "x.jsonl", "--out", ""], "cannot write to '': an empty path"),
    (["devices", "--check", "--out", ""], "cannot write to '': an empty path"),
    (["run", "hi", "--device", "npu"], "device must be torch's device for the target"),
])
def test_flags_are_taken_whole_and_empty_paths_refused(args, says):
    """A shortened flag was read as the flag it starts (`bench --mode ar` failed as `--model ar`: model not found);
    `--out ''` wrote a bench's files or the check's JSON into the current folder; `--device npu` was torch's
    traceback."""
    assert_one_line_error(run_cli(*args), says)


def test_stdin_that_is_not_utf8_is_one_line_naming_the_byte():
    proc = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "run", "--model", "tiny", "--max-new-tokens", "2"],
                          input=b"ok \xc3\x28", capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "mirror-rt: error: stdin is not UTF-8 text: byte 0xc3 at offset 3"
