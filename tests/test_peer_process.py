"""Third-party peers in child processes (evaluation.peer_process): a peer that dies of a signal, as OpenVINO GenAI's
ContinuousBatchingPipeline does with SIGFPE at 1 thread and bf16 on AMX Xeons, becomes a skipped row with its reason
in `bench` and `bench-serve`, and the run goes on. The crash is injected by tests/site_hooks/sitecustomize.py, which
every process started with that folder on PYTHONPATH loads (the child processes included), through the console
script (tests/cli_support.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from cli_support import console, hooked_env

SIGFPE = "its process died of SIGFPE (Floating point exception)"


def test_a_peer_that_dies_building_is_skipped_with_its_reason(monkeypatch, tmp_path):
    pytest.importorskip("openvino_genai")
    from mirror_rt.evaluation.peer_process import SkippedPeer, serve_peers

    for name, value in hooked_env(crash="build").items():
        monkeypatch.setenv(name, value)
    lines = []
    peers = serve_peers(["ov-genai-cb"], "tiny", 1, cache=str(tmp_path), log=lines.append)
    assert peers == [SkippedPeer("ov-genai-cb", f"{SIGFPE} while loading")]


@pytest.mark.parametrize("stage", ["build", "generate"])
def test_bench_reports_a_dead_peer_as_a_skipped_row_and_goes_on(stage, tmp_path):
    pytest.importorskip("openvino_genai")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "a", "turns": [f"hello {i}"]}) + "\n"
                            for i in range(2)))
    out = tmp_path / "out"
    proc = console("bench", "--data", str(data), "--model", "tiny", "--methods", "ar,ov-genai", "--max-new-tokens",
                     "4", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), crash=stage)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    why = f"{SIGFPE} while {'loading' if stage == 'build' else 'answering'}"
    assert f"bench: skipping ov-genai: {why}" in proc.stderr
    assert doc["skipped"] == {"ov-genai": why} and f"Skipped row `ov-genai`: {why}" in report
    assert "ov-genai" not in doc["summary"]["overall"] and doc["summary"]["overall"]["ar-torch-1t"]["questions"] == 2


def test_bench_serve_reports_dead_peers_in_each_table_and_goes_on(engine, tmp_path):
    """Against a real server: the GenAI peers die at their first step (the warm-up); every level still runs, each
    table has their rows saying why, and the run ends normally."""
    pytest.importorskip("fastapi")
    from serve_support import start

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "a", "turns": [f"say {i} in words"]}) + "\n"
                            for i in range(2)))
    server = start(engine, max_queued=4)
    try:
        proc = console("bench-serve", "--url", server.url, "--data", str(data), "--concurrency", "1,2",
                         "--max-tokens", "4", "--peers", "ov-genai-cb,ov-genai-cb-f32", "--model", "tiny",
                         # 2 threads: at 1, GenAI's ContinuousBatchingPipeline really dies of SIGFPE while it is
                         # built on a Xeon with AMX (bf16), before the injected crash at its first step
                         "--threads", "2", "--cache-dir", str(tmp_path / "cache"), "--json",
                         str(tmp_path / "r.json"), crash="generate")
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    why = f"{SIGFPE} while running"
    assert f"bench-serve: skipping ov-genai-cb: {why}" in proc.stderr
    assert proc.stderr.count(f"| ov-genai-cb | - | - | skipped: {why} |") == 2
    assert proc.stderr.count(f"| ov-genai-cb-f32 | - | - | skipped: {why} |") == 2
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [level["completed"] for level in doc["levels"]] == [2, 2]
    assert all(level["peers"]["ov-genai-cb"] == {"skipped": why} for level in doc["levels"])


def test_a_process_whose_peer_is_alive_exits_without_closing_it(tmp_path):
    """A peer still running when its parent ends (bench-serve's `mirror-rt-engine` after the last level) is closed
    at exit: the parent exits at once instead of waiting forever for a child that waits for its pipe to close."""
    (tmp_path / "pingpeer.py").write_text(textwrap.dedent("""
        class Peer:
            name = "ping"
            def ping(self):
                return "pong"

        def build(log=print):
            return [Peer()]
    """))
    (tmp_path / "parent.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from mirror_rt.evaluation.peer_process import start_peers

        if __name__ == "__main__":
            print(start_peers(["ping"], "pingpeer:build", ())[0].ping())
    """))
    proc = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "pong", proc.stderr[-2000:]
