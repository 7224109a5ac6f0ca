"""The replica side of `mirror-rt serve --replicas`, without a cluster: the proxy middleware (retry of what a
lost replica never answered, the envelope on the proxy's own errors, closing a cut stream), the replica
header, the metrics sink, the health verdict, what a replica asks for, and the one-line refusal without
Ray. The last test runs the CLI on a local Ray (skipped without Ray)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from serve_support import RunningServer, tiny_engine

from mirror_rt.runtime.batch.decoder import BatchConfig

pytest.importorskip("fastapi")

from mirror_rt.serving.cluster import ClusterConfig, ClusterError, deployment_options, replica_resources  # noqa: E402
from mirror_rt.serving.proxy import BUSY_PATIENCE_S, REPLICA_HEADER, ReplicaLoss  # noqa: E402
from mirror_rt.serving.replica import ReplicaHeader, health_problem, own_cores  # noqa: E402
from mirror_rt.serving.settings import ServerConfig  # noqa: E402

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
BODY = b'{"prompt": "hello"}'
JSON = (b"content-type", b"application/json")
STREAM = (b"content-type", b"text/event-stream")
NAMED = (REPLICA_HEADER, b"r1")


class Downstream:
    """The proxy behind the middleware: one script (messages to send, or an exception) per attempt."""

    def __init__(self, *attempts):
        self.attempts, self.bodies = list(attempts), []

    async def __call__(self, scope, receive, send):
        self.bodies.append((await receive())["body"])
        script = self.attempts.pop(0)
        if isinstance(script, Exception):
            raise script
        for message in script:
            await send(message)


def start(status: int, *headers) -> dict:
    return {"type": "http.response.start", "status": status, "headers": list(headers)}


def chunk(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def run(app, leaves: bool = False) -> list[dict]:
    """Drive the middleware over `app` with one request; the messages the client got."""
    sent, requested = [], [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive():
        if requested:
            return requested.pop(0)
        if leaves:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(ReplicaLoss(app)(dict(SCOPE), receive, send))
    return sent


def answer(sent: list[dict]) -> tuple[int, dict, bytes]:
    head = sent[0]
    assert head["type"] == "http.response.start" and not sent[-1].get("more_body", False)
    return head["status"], dict(head["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_a_request_whose_replica_was_lost_before_answering_is_sent_again():
    """The proxy sends nothing when the replica dies: the same body goes out once more, its answer returns."""
    app = Downstream([], [start(200, JSON, NAMED), chunk(b'{"ok": 1}')])
    status, headers, body = answer(run(app))
    assert (status, body, headers[REPLICA_HEADER]) == (200, b'{"ok": 1}', b"r1")
    assert app.bodies == [BODY, BODY]


def test_a_second_loss_is_a_500_in_the_envelope():
    app = Downstream([], RuntimeError("actor died"))
    status, _, body = answer(run(app))
    error = json.loads(body)["error"]
    assert status == 500 and error["code"] == 500 and "lost" in error["message"] and "actor died" in error["message"]
    assert len(app.bodies) == 2


BUSY = [start(503, (b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")),
        chunk(b"Request dropped due to backpressure (num_queued_requests=4, max_queued_requests=4).")]


def test_the_proxys_backpressure_503_gets_the_envelope_and_keeps_retry_after():
    """Serve's "at its limit", still so after BUSY_PATIENCE_S of asking again, goes out in the envelope."""
    app = Downstream(*[BUSY] * 100)
    t0 = time.monotonic()
    status, headers, body = answer(run(app))
    assert status == 503 and headers[b"retry-after"] == b"1" and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["error"]["message"] == ("the server is busy: every replica is at its limit and 4 "
                                                     "requests wait; retry later")
    assert BUSY_PATIENCE_S <= time.monotonic() - t0 < BUSY_PATIENCE_S + 1 and 2 <= len(app.bodies) < 100


def test_a_burst_refused_by_serves_lagging_count_is_asked_again_and_answered():
    """Serve refused requests of a burst although replicas had room (its count of its queue lags): asked again
    a moment later, the request gets its answer."""
    app = Downstream(BUSY, BUSY, [start(200, JSON, NAMED), chunk(b'{"ok": 1}')])
    status, _, body = answer(run(app))
    assert (status, body) == (200, b'{"ok": 1}') and app.bodies == [BODY] * 3


def test_a_replica_whose_engine_stopped_is_retried_and_its_answer_kept_for_the_last_attempt():
    """`x-mirror-rt-retry`: the request goes to another replica; a second refusal reaches the client as sent."""
    retry = (b"x-mirror-rt-retry", b"engine-stopped")
    refusal = b'{"error": {"message": "the engine stopped", "code": 503}}'
    app = Downstream([start(503, JSON, NAMED, retry), chunk(refusal)], [start(200, JSON, NAMED), chunk(b'{"ok": 1}')])
    assert answer(run(app))[::2] == (200, b'{"ok": 1}') and len(app.bodies) == 2
    twice = Downstream([start(503, JSON, NAMED, retry), chunk(refusal)], [start(503, JSON, NAMED, retry),
                                                                          chunk(refusal)])
    status, headers, body = answer(run(twice))
    assert (status, body, headers[b"x-mirror-rt-retry"]) == (503, refusal, b"engine-stopped")


def test_a_replicas_own_error_passes_unchanged_and_is_not_retried():
    error = b'{"error": {"message": "generation failed", "code": 500}}'
    app = Downstream([start(500, JSON, NAMED), chunk(error)])
    assert answer(run(app)) == (500, {b"content-type": b"application/json", REPLICA_HEADER: b"r1"}, error)
    assert len(app.bodies) == 1


def test_a_stream_cut_by_a_lost_replica_ends_with_an_error_event_and_done():
    app = Downstream([start(200, STREAM, NAMED), chunk(b'data: {"text": "a"}\n\n', more=True)])
    status, _, body = answer(run(app))
    events = [line for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[0] == 'data: {"text": "a"}' and events[-1] == "data: [DONE]"
    assert "lost" in json.loads(events[-2][6:])["error"]["message"]
    assert len(app.bodies) == 1  # text went out: never sent again


def test_no_retry_for_a_client_that_left():
    class Leaving(Downstream):
        async def __call__(self, scope, receive, send):
            await super().__call__(scope, receive, send)
            await receive()  # the proxy watches for the disconnect, and stops

    app = Leaving([], [start(200, JSON, NAMED), chunk(b"{}")])
    assert run(app, leaves=True) == [] and len(app.bodies) == 1


def test_every_replica_response_names_the_replica():
    from mirror_rt.serving.app import ServerConfig, create_app

    app = create_app(ServerConfig(), tiny_engine)
    app.add_middleware(ReplicaHeader, replica="abc123")
    server = RunningServer(app).wait_ready()
    try:
        assert httpx.get(server.url + "/health").headers[REPLICA_HEADER.decode()] == "abc123"
        missing = httpx.post(server.url + "/v1/completions", json={"prompt": ""})
        assert missing.status_code == 400 and missing.headers[REPLICA_HEADER.decode()] == "abc123"
    finally:
        server.stop()


class Recorded:
    """A metrics sink that records every update: {(name, labels): [(verb, value), ...]}."""

    def __init__(self):
        self.families, self.updates = {}, {}

    def __call__(self, kind, name, doc, label_names, buckets):
        self.families[name] = (kind, tuple(label_names), buckets)
        return self.Family(self, name)

    class Family:
        def __init__(self, sink, name, values=()):
            self.sink, self.name, self.values = sink, name, values

        def labels(self, *values):
            return type(self)(self.sink, self.name, values)

        def _record(self, verb, value):
            self.sink.updates.setdefault((self.name, self.values), []).append((verb, value))

        def inc(self, amount=1):
            self._record("inc", amount)

        def set(self, value):
            self._record("set", value)

        def observe(self, value):
            self._record("observe", value)


def test_every_metric_update_also_reaches_the_sink():
    """The app's metrics tee into a sink (a Ray replica's export): same names, labels and updates."""
    from mirror_rt.serving.app import ServerConfig, create_app
    from mirror_rt.serving.metrics import TTFT_BUCKETS

    sink = Recorded()
    server = RunningServer(create_app(ServerConfig(), tiny_engine, metrics_sink=sink)).wait_ready()
    try:
        request = {"prompt": "hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "mode": "sd"}
        assert httpx.post(server.url + "/v1/completions", json=request, timeout=60).status_code == 200
    finally:
        server.stop()
    assert sink.families["time_to_first_token_seconds"] == ("histogram", ("model_name",), TTFT_BUCKETS)
    assert sink.families["request_success"] == ("counter", ("model_name", "finished_reason"), None)
    assert sink.updates[("request_success", ("tiny", "length"))] == [("inc", 1)]
    assert sink.updates[("generation_tokens", ("tiny",))] == [("inc", 5)]
    assert ("set", 1) in sink.updates[("num_requests_running", ("tiny",))]
    assert len(sink.updates[("e2e_request_latency_seconds", ("tiny",))]) == 1
    assert sink.updates[("spec_decode_num_draft_tokens", ("tiny",))][0][1] > 0


def test_health_fails_for_a_failed_load_or_a_dead_engine_thread():
    alive = SimpleNamespace(alive=lambda: True)
    dead = SimpleNamespace(alive=lambda: False)
    assert health_problem(SimpleNamespace(status="ready", scheduler=alive)) is None
    assert health_problem(SimpleNamespace(status="loading", scheduler=None)) is None
    assert health_problem(SimpleNamespace(status="ready", scheduler=dead)) == "the engine thread is dead"
    failed = SimpleNamespace(status="failed", error="OSError: no weights", scheduler=None)
    assert health_problem(failed) == "the engine failed to load: OSError: no weights"


@pytest.mark.parametrize("mode, target, draft, threads, expected", [
    ("mirror", "cpu", "cpu", None, {"num_cpus": 2, "num_gpus": 0}),  # Mirror on CPU: a core per worker
    ("mirror", "cpu", "cpu", 2, {"num_cpus": 4, "num_gpus": 0}),
    ("sd", "cpu", "cpu", None, {"num_cpus": 1, "num_gpus": 0}),  # target and draft take turns
    ("ar", "cpu", "npu", 2, {"num_cpus": 2, "num_gpus": 0}),  # ar runs no draft
    ("mirror", "cuda", "cpu", None, {"num_cpus": 1, "num_gpus": 1}),
    ("mirror", "torch:cuda", "npu", None, {"num_cpus": 0, "num_gpus": 1, "resources": {"intel_npu": 1}}),
    ("mirror", "openvino:GPU", "openvino:NPU", None,
     {"num_cpus": 0, "num_gpus": 0, "resources": {"intel_gpu": 1, "intel_npu": 1}}),
    ("mirror", "ort:cpu", "ort:qnn", None, {"num_cpus": 1, "num_gpus": 0, "resources": {"qnn_npu": 1}}),
])
def test_a_replica_asks_for_the_devices_its_roles_run_on(mode, target, draft, threads, expected):
    assert replica_resources(mode, target, draft, threads) == expected


@pytest.mark.parametrize("cores, num_cpus, rank, expected", [
    ([0, 1], 1, 0, [0]),
    ([0, 1], 1, 1, [1]),
    ([0, 1, 2, 3], 2, 1, [2, 3]),
    ([0, 1, 2, 3], 2, 2, [0, 1]),  # more replicas than the node holds: they wrap round
    ([4, 5, 6], 1, 2, [6]),  # the cores this process may use, not 0..n-1
    ([0, 1], 2, 0, None),  # the whole node: nothing to choose
    ([0, 1], 0, 0, None),  # no whole CPU asked for
])
def test_a_replica_takes_its_own_cores_by_its_rank_on_the_node(cores, num_cpus, rank, expected):
    assert own_cores(cores, num_cpus, rank) == expected


def test_max_queued_0_with_replicas_is_refused_before_ray_starts(monkeypatch):
    """Serve's proxy queues at least one request: --max-queued 0 failed after Ray's start-up in pydantic's
    four lines; now one line, at once."""
    from mirror_rt.serving import cluster

    monkeypatch.setattr(cluster, "start", lambda *a: pytest.fail("Ray started"))
    with pytest.raises(ClusterError, match="^--max-queued 0 needs a single engine"):
        cluster.serve_replicas(ServerConfig(max_queued=0), ClusterConfig(replicas=2), tiny_engine)


def test_a_cuda_index_is_refused_with_replicas():
    with pytest.raises(ClusterError, match="without an index"):
        replica_resources("mirror", "cuda:1", "cpu")


def test_replica_limits_and_autoscaling_map_onto_the_deployment():
    fixed = deployment_options(ClusterConfig(replicas=3), ServerConfig(max_queued=7, retry_after_s=2))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == BatchConfig().max_num_seqs + 1 and fixed["max_queued_requests"] == 7
    assert deployment_options(ClusterConfig(batch_rows=3), ServerConfig())["max_ongoing_requests"] == 4
    assert fixed["backpressure_config"] == {"retry_after_s": 2}
    scaled = deployment_options(ClusterConfig(replicas=2, max_replicas=4, target_ongoing_requests=1.5),
                                ServerConfig())
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                            "target_ongoing_requests": 1.5}
    with pytest.raises(ClusterError, match="--min-replicas 3 is more than --max-replicas 2"):
        ClusterConfig(min_replicas=3, max_replicas=2)


def test_replicas_without_ray_fail_in_one_line_naming_the_extra(monkeypatch, capsys):
    from mirror_rt.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--replicas", "2", "--torch", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'mirror-rt: error: serving replicas needs Ray Serve: pip install "mirror-rt[cluster]"'


def test_the_cli_serves_two_replicas_on_a_local_ray_and_stops_on_sigterm(tmp_path):
    """`mirror-rt serve --replicas 2`, as the README runs it: both replicas answer, SIGTERM drains and exits 0."""
    pytest.importorskip("ray.serve")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "mirror_rt.cli", "serve", "--replicas", "2", "--torch", "--model", "tiny",
               "--mode", "ar", "--threads", "1", "--port", str(port)]
    log = tmp_path / "stderr"

    def said() -> list[str]:
        return [line for line in log.read_text().splitlines() if line.startswith("mirror-rt serve: ")]

    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        seen, deadline = set(), time.monotonic() + 120
        while (len(seen) < 2 or not said()) and time.monotonic() < deadline and process.poll() is None:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                      json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
                if response.status_code == 200:
                    seen.add(response.headers[REPLICA_HEADER.decode()])
            except httpx.TransportError:
                time.sleep(0.5)
        assert len(seen) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=90)
    lines = said()
    assert process.returncode == 0 and lines[-1] == "mirror-rt serve: stopped"
    assert "serving 2 replicas at" in lines[0] and "{'num_cpus': 1, 'num_gpus': 0}" in lines[0]


def test_kuberay_builds_the_same_app_from_serve_options():
    """`mirror_rt.cli:ray_serve_app` (a RayService's import_path) turns `mirror-rt serve` options into the app."""
    serve = pytest.importorskip("ray.serve")
    from mirror_rt.cli import build_parser, ray_serve_app
    from mirror_rt.cli.serve import cluster_config, serve_parts

    options = "--torch --model tiny --mode mirror --replicas 3 --max-queued 5 --device cuda"
    assert isinstance(ray_serve_app({"options": options}), serve.Application)
    parsed = build_parser().parse_args(["serve", *options.split()])
    settings = cluster_config(parsed, torch_engine=True)
    assert (settings.replicas, serve_parts(parsed)[0].max_queued) == (3, 5)
    assert settings.actor_options == {"num_cpus": 1, "num_gpus": 1}  # the CUDA target, the draft on a core
