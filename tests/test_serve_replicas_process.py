"""`serve --replicas` as a process (`cluster.serve_replicas` over two replicas of the slowed tiny engine, on a
local Ray): the page's files, /health, /server and /metrics answer while every replica is at its limit; /server
names the replica that answered and the queue the user asked for; SIGTERM drains as the single server does (the
admitted requests finish, a stream still running at the deadline ends with an error event and [DONE], new ones get
503) and the process exits 0. The drain test ends the module's server, so it comes last. Skipped without Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_support import SUBMITTED, free_port, wait_for, wait_for_line

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve")

TESTS = str(Path(__file__).resolve().parent)
HEADER = "x-mirror-rt-replica"
DRAIN = 6  # seconds: the requests of 40 tokens finish within it, those of 200 do not
QUEUED = 2
LAUNCH = f"""
import functools, sys
from serve_support import replica_engine
from mirror_rt.serving import cluster
from mirror_rt.serving.settings import ClusterConfig, ServerConfig
port, cues = int(sys.argv[1]), sys.argv[2]
server = ServerConfig(port=port, max_queued={QUEUED}, drain_timeout={DRAIN}, request_timeout=120)
replicas = ClusterConfig(replicas=2, batch_rows=1, placement_timeout=20, actor_options={{
    "num_cpus": 1, "runtime_env": {{"env_vars": {{"PYTHONPATH": sys.argv[3]}}}}}})
sys.exit(cluster.serve_replicas(server, replicas, functools.partial(replica_engine, cues, 0.05)))
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The process, its URL and its log; killed at the end if a test left it running."""
    folder = tmp_path_factory.mktemp("replicas")
    port, log = free_port(), folder / "stderr"
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", LAUNCH, str(port), str(folder), path],
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=dict(os.environ, PYTHONPATH=path))
    try:
        wait_for_line(log, "serving 2 replicas", process, timeout=180)
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def body(max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "mode": "ar", **extra}


def post_in_background(url: str, bodies: list[dict], every: float = 0) -> tuple[list, list[threading.Thread]]:
    """The bodies posted one thread each, `every` seconds apart (Serve's queue limit is loose under a burst)."""
    answers, threads = [], []
    for one in bodies:
        def post(one=one):
            try:
                answers.append(httpx.post(url + "/v1/completions", json=one, timeout=120))
            except httpx.HTTPError as exc:
                answers.append(exc)
        threads.append(threading.Thread(target=post))
        threads[-1].start()
        time.sleep(every)
    return answers, threads


def test_the_page_and_probes_answer_while_every_replica_is_at_its_limit(served):
    """2 replicas x (1 row + 1 ready) + 2 waiting: the 7th generation is refused, never a page file or a probe."""
    _, url, _ = served
    answers, threads = post_in_background(url, [body(120) for _ in range(7)], every=0.4)
    try:
        assert wait_for(lambda: any(getattr(a, "status_code", 0) == 503 for a in answers), timeout=30)
        for path in ("/", "/ui/server.js", "/ui/page.css", "/health", "/server", "/metrics"):
            response = httpx.get(url + path, timeout=10)
            assert response.status_code == 200, (path, response.text[:200])
        assert httpx.get(url + "/ui/nothing.js", timeout=10).status_code == 404
    finally:
        for thread in threads:
            thread.join(120)
    assert sorted(getattr(a, "status_code", a) for a in answers).count(200) >= 5


def test_server_names_the_replica_that_answered_and_the_queue_asked_for(served):
    _, url, _ = served
    seen = set()
    for _ in range(4):
        response = httpx.get(url + "/server", timeout=10)
        assert response.status_code == 200 and response.json()["max_queued"] == QUEUED
        seen.add(response.headers[HEADER])
    assert len(seen) == 2  # the replicas answer in turn, each named


def taken(submitted: Path) -> int:
    """Generations the replicas' engines have taken so far."""
    return len(submitted.read_text().splitlines()) if submitted.exists() else 0


def sse_events(url: str, request: dict, events: list, third: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=request, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    third.set()


def test_sigterm_drains_the_replicas_then_exits_0(served):
    """As the single server: what was admitted finishes (or ends cleanly at the deadline), new requests get 503."""
    process, url, log = served
    submitted = log.parent / SUBMITTED  # each replica engine's generations, a line each (serve_support.Mortal)
    before = taken(submitted)
    short, long, third = [], [], threading.Event()
    readers = [threading.Thread(target=sse_events, args=(url, body(40, stream=True), short, third)),
               threading.Thread(target=sse_events, args=(url, body(200, stream=True), long, threading.Event()))]
    for reader in readers:
        reader.start()
    answers, threads = post_in_background(url, [body(40)])
    assert third.wait(60)
    assert wait_for(lambda: taken(submitted) == before + 3, timeout=30)  # the three admitted: none still at the proxy
    process.send_signal(signal.SIGTERM)
    assert wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, timeout=20)
    late = httpx.post(url + "/v1/completions", json=body(4), timeout=30)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    for thread in [*readers, *threads]:
        thread.join(120)
    assert process.wait(timeout=90) == 0
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 40
    assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"]
    lines = [line for line in log.read_text().splitlines() if line.startswith("mirror-rt serve: ")]
    assert any("draining" in line for line in lines) and lines[-1] == "mirror-rt serve: stopped"
