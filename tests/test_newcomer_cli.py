"""What a newcomer meets through the console script (issue 51): a missing optional extra is one line naming it,
`run --help` says what --model runs and where the cache is, the server's start-up lines give the playground's URL,
and a single prompt's `--stats` speaks of one prompt, not of a server's load."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest
from cli_support import ROOT, console, hooked_env


@pytest.mark.parametrize("args, hidden, extra", [
    (["serve", "--model", "tiny", "--port", "9"], "fastapi", "serve"),
    (["serve", "--model", "tiny", "--port", "9"], "uvicorn", "serve"),
    (["serve", "--model", "tiny", "--port", "9", "--replicas", "2"], "ray", "cluster"),
])
def test_a_missing_extra_is_one_line_naming_it(args, hidden, extra):
    proc = console(*args, hide=hidden, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("mirror-rt: error: ") and f"mirror-rt[{extra}]" in lines[0]


def test_bench_serve_without_its_client_is_one_line(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n')
    proc = console("bench-serve", "--url", "http://127.0.0.1:9", "--data", str(data), hide="openai", timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "mirror-rt: error: mirror-rt bench-serve needs openai, which is not installed: pip install openai"]


def test_run_help_says_what_model_runs_and_where_the_cache_is():
    text = " ".join(console("run", "--help", timeout=120).stdout.split())
    assert "a .gguf file or a folder over 1 GB runs as a bundle" in text and "; runs torch eager" not in text
    assert "$MIRROR_RT_CACHE, else $XDG_CACHE_HOME/mirror-rt, else ~/.cache/mirror-rt" in text


def test_serving_doc_shows_real_start_up_lines():
    text = (ROOT / "docs" / "serving.md").read_text()
    assert "STARTLINE" not in text and "mirror-rt serve: playground: open http://127.0.0.1:8000/" in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("host, shown", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1")])
def test_the_server_start_up_lines_give_the_playground_url(host, shown):
    """A real server process: once the engine is ready, a line gives the page's URL (a browsable address when it
    listens on every interface); --no-ui gives none."""
    import shutil
    import sys
    from pathlib import Path

    port = _free_port()
    script = shutil.which("mirror-rt", path=str(Path(sys.executable).parent)) or shutil.which("mirror-rt")
    server = subprocess.Popen([script, "serve", "--model", "tiny", "--host", host, "--port", str(port)],
                              stderr=subprocess.PIPE, text=True, env=hooked_env())
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any("no API key:" in line for line in lines):
            line = server.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    page = [line for line in lines if "playground" in line]
    assert page == [f"mirror-rt serve: playground: open http://{shown}:{port}/ in a browser (a chat page on this "
                    "server; --no-ui: none)\n"], "".join(lines)


def test_single_prompt_stats_speak_of_one_prompt():
    proc = console("run", "--model", "tiny", "--stats", "--max-new-tokens", "48", "hello there", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    why = [line for line in proc.stderr.splitlines() if "target-only:" in line or line.startswith("no speculation")]
    assert why and "the first steps timed target-only decoding" in why[0]
    assert "at this batch size" not in proc.stderr and "load policy" not in proc.stderr



def test_a_long_conversion_says_it_is_at_work(monkeypatch, tmp_path):
    """First run: transformers reads the GGUF for a minute or more before its tensor bar; a line says so meanwhile."""
    from mirror_rt.models import default_model

    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / default_model.GGUF_NAME).write_bytes(b"")
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, folder, log: time.sleep(1.0) or folder)
    monkeypatch.setattr(default_model, "HEARTBEAT_S", 0.05)
    lines = []
    default_model.default_model_folder(tmp_path, log=lines.append)
    assert lines and all(line.startswith(f"converting {default_model.GGUF_NAME}: still at work, ") and
                         line.endswith("s so far (about 1.5 min on 2 cores, longer on a loaded machine)")
                         for line in lines)


@pytest.mark.parametrize("converted", [False, True])
def test_the_first_run_line_gives_a_measured_estimate(monkeypatch, tmp_path, converted):
    from mirror_rt.devices import engines

    if converted:
        (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
        (tmp_path / "models" / "smollm2-135m-instruct" / "model.safetensors").write_bytes(b"")
    said = []
    monkeypatch.setattr(engines, "_cached_bundle", lambda folder, export, message, log: said.append(message))
    engines.default_bundle(str(tmp_path))
    assert "about 30 s" not in said[0]
    assert ("about 2.5 min on 2 cores" if converted else "convert the GGUF, export: about 4 min on 2 cores") in said[0]
