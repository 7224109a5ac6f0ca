"""`mirror-rt serve` as a user starts it: the default engine (the cached default bundle, what `run` uses),
the start-up line, greedy text over HTTP equal to target-only decoding, and a drain on SIGTERM that
finishes the request in flight, answers 503 to new ones and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_support import free_port, wait_for_line

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three primary colors and say one thing about each."}]


@pytest.fixture(scope="module")
def default_ar_text(cache_dir):
    from mirror_rt.devices.engines import load_engine
    from mirror_rt.devices.options import EngineConfig

    engine = load_engine(EngineConfig.from_flags(cache_dir=cache_dir), "ar", log=lambda *a: None)
    return engine.generate(QUESTION, mode="ar", max_new_tokens=96).text


def test_serve_drains_on_sigterm_and_exits_0(tmp_path, cache_dir, default_ar_text):
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, MIRROR_RT_CACHE=cache_dir)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.cli", "serve", "--port", str(port),
                                 "--drain-timeout", "60"], stderr=err, stdout=subprocess.DEVNULL, env=env)
    try:
        line = wait_for_line(log, "serving ", proc, timeout=600)
        assert f"http://127.0.0.1:{port}/v1" in line and "smollm2-135m-instruct" in line and "mode mirror" in line
        assert "target on ort:cpu" in line and "draft on ort:cpu" in line and "no API key" in line
        # the budget an operator can predict, said at start (it was 40% of the memory free at that moment)
        assert "KV budget 4.00 GiB" in line and "default: 4 GiB or every row at full length" in line
        assert "prefix cache up to" in line and "of those blocks (50%; the target's KV only" in line
        warning = wait_for_line(log, "no API key:", proc, timeout=10)
        assert "any program on this machine can use" in warning and "--allowed-origins" in warning
        url = f"http://127.0.0.1:{port}"
        events, first = [], threading.Event()

        def stream():
            body = {"messages": QUESTION, "max_tokens": 96, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
                for raw in response.iter_lines():
                    if raw.startswith("data: "):
                        events.append(raw[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        reader.join(120)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == default_ar_text  # the request in flight finished, lossless through HTTP
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "draining" in log.read_text() and "stopped" in log.read_text()


def test_a_second_signal_ends_every_stream_with_an_error_and_exits_143(tmp_path, cache_dir):
    """A second SIGTERM cuts the drain short: every open stream ends with an error event and [DONE] (they were cut
    with neither, and the process exited 0, as a clean drain does), the process exits 143 (128 + SIGTERM), and the
    engine thread ends its step before the interpreter exits (it exited under a running ONNX Runtime call:
    "terminate called", SIGABRT)."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, MIRROR_RT_CACHE=cache_dir)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.cli", "serve", "--port", str(port)],
                                stderr=err, stdout=subprocess.DEVNULL, env=env)
    streams = [[] for _ in range(5)]
    try:
        wait_for_line(log, "serving ", proc, timeout=600)
        url, first = f"http://127.0.0.1:{port}", threading.Event()

        def stream(messages, events):
            body = {"messages": messages, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                    "POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        long = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 300}]
        readers = [threading.Thread(target=stream, args=(QUESTION, streams[0]))]
        readers += [threading.Thread(target=stream, args=(long, events)) for events in streams[1:]]  # prefilling
        readers[0].start()
        assert first.wait(120)
        for reader in readers[1:]:
            reader.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        for reader in readers:
            reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for events in streams:
        assert len(events) >= 3 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
    text = log.read_text()
    assert "terminate called" not in text and "stopped by a second signal (exit 143)" in text
    assert "Traceback" not in text  # the tasks uvicorn cancels at a forced stop are the stop, not faults


def test_serve_refuses_a_bad_model_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "serve", "--model", str(tmp_path / "none"),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("mirror-rt: error:")]
    assert len(errors) == 1 and "model not found" in errors[0]
    assert result.stderr.count("model not found") == 1, result.stderr  # not also the loading thread's log line


def test_a_port_in_use_or_an_unknown_host_is_one_line_and_exit_1(tmp_path):
    """Before, the server said it was listening, then uvicorn logged the bind error and exited 3 (once with a C++
    abort from the engine's loading thread); now nothing loads and one line says what the machine refused."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, says, more in (("127.0.0.1", "in use", []), ("no-such-host.invalid", "", []),
                                 ("127.0.0.1", "in use", ["--replicas", "2"])):  # Ray's proxy: its traceback
            result = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "serve", "--host", host, "--port",
                                     str(port), *more], capture_output=True, text=True, timeout=120)
            assert result.returncode == 1, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"mirror-rt: error: cannot listen on {host}:{port}: ")
            assert says in lines[0] and "listening on" not in result.stderr


def test_a_sigterm_before_uvicorn_runs_drains_like_one_after(tmp_path, cache_dir):
    """The signal can come between "listening on" and uvicorn's own handlers (the full suite's load made that window
    wide enough once: exit -15): it drains and exits 0 as it does later. Here it is sent right before uvicorn runs."""
    from mirror_rt.devices.engines import default_bundle

    bundle = default_bundle(cache_dir, progress=False)
    log = tmp_path / "serve.log"
    script = ("import os, signal, sys, uvicorn\n"
              "run = uvicorn.Server.run\n"
              "def early(self, *a, **k):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return run(self, *a, **k)\n"
              "uvicorn.Server.run = early\n"
              "from mirror_rt.cli import main\n"
              f"sys.exit(main(['serve', '--port', '{free_port()}', '--bundle', {str(bundle)!r}]))\n")
    with open(log, "w") as err:
        done = subprocess.run([sys.executable, "-c", script], stderr=err, stdout=subprocess.DEVNULL, timeout=120)
    text = log.read_text()
    assert done.returncode == 0, text
    assert "draining" in text and "Traceback" not in text


def test_serve_stopped_while_loading_exits_0_without_an_abort(tmp_path, cache_dir):
    """SIGTERM while the engine still loads (here ONNX Runtime building sessions of a bundle not seen before): the
    interpreter used to exit under the loading thread and abort ('terminate called without an active exception',
    exit 134, 2 runs in 3); it exits 0 and says so."""
    import shutil

    from mirror_rt.devices.engines import default_bundle

    source = default_bundle(cache_dir, progress=False)
    bundle = tmp_path / "bundle"  # its files without ONNX Runtime's cache: loading takes seconds
    bundle.mkdir()
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, bundle / f.name)
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mirror_rt.cli", "serve", "--port", str(port), "--bundle",
                                 str(bundle)], stderr=err, stdout=subprocess.DEVNULL)
    try:
        wait_for_line(log, "listening on", proc, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped while the engine was loading" in text and "terminate called" not in text
