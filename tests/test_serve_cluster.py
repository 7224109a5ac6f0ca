"""`mirror-rt serve --replicas`: the app on Ray Serve, two replicas of the tiny engine (one CPU each) behind
Serve's proxy, on one local Ray shared by the module. Greedy text through any replica equals the reference
decoder's; a replica lost mid-request costs its client a clean error (streaming) or nothing (a retry), and
comes back; overload is a 503 with Retry-After from the proxy; every replica's metrics reach Ray's export
with its label. Skipped without Ray."""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from serve_support import replica_engine, tiny_engine

pytest.importorskip("fastapi")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from mirror_rt.serving import cluster  # noqa: E402 -- after the skips: it needs the serve extra
from mirror_rt.serving.app import ServerConfig  # noqa: E402

PROMPT = "hello there"
TESTS = str(Path(__file__).resolve().parent)
HEADER = "x-mirror-rt-replica"
SERVER = ServerConfig(max_queued=4, request_timeout=60, drain_timeout=2)  # the port: free at start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cues(tmp_path_factory):
    """Where a test leaves the cue that makes one replica's engine die (`serve_support.Mortal`)."""
    return tmp_path_factory.mktemp("cues")


@pytest.fixture(scope="module")
def ray_cluster(cues):
    """One local Ray and Serve for the module, with the app deployed on two replicas."""
    metrics_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 500})
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    settings = cluster.ClusterConfig(
        replicas=2, actor_options={"num_cpus": 1, "runtime_env": {"env_vars": {"PYTHONPATH": path}}},
        placement_timeout=10, health_check_period_s=1)
    server = replace(SERVER, port=free_port())
    try:
        cluster.start_serve(settings, server)
        cluster.deploy(cluster.build(server, settings, functools.partial(replica_engine, str(cues))))
        yield settings, f"http://127.0.0.1:{server.port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    return tiny_engine()


def body(max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def ar_text(reference, max_new: int) -> str:
    return reference.generate(PROMPT, mode="ar", max_new_tokens=max_new, chat=False, ignore_eos=True).text


def post_timed(url: str, bodies: list[dict], timeout: float = 60) -> list[tuple[httpx.Response, float, float]]:
    """The bodies posted at once, one thread each: (response, sent at, answered at) in order."""
    results = [None] * len(bodies)

    def post(i):
        sent = time.monotonic()
        response = httpx.post(url + "/v1/completions", json=bodies[i], timeout=timeout)
        results[i] = (response, sent, time.monotonic())

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    return [response for response, _, _ in post_timed(url, bodies)]


def live_replicas() -> set[str]:
    """Tags of the replica actors alive now."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.rsplit("#", 1)[1] for n in names if n.startswith(f"SERVE_REPLICA::{cluster.APP}#")}


def kill_replica(tag: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{cluster.APP}#{cluster.DEPLOYMENT}#{tag}", namespace="serve"),
             no_restart=True)


def wait_two_running(gone: set[str], timeout: float = 60) -> set[str]:
    """Wait until two replicas run again, none of them in `gone`; their tags."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications[cluster.APP]
        states = status.deployments[cluster.DEPLOYMENT].replica_states
        tags = live_replicas()
        if states.get("RUNNING") == 2 and len(tags) == 2 and not tags & gone:
            return tags
        time.sleep(0.2)
    raise TimeoutError(f"two replicas not back within {timeout} s: {serve.status().applications[cluster.APP]}")


def answer_from_both(url: str, reference, rounds: int = 6) -> set[str]:
    """Rounds of four concurrent greedy requests until both replicas have answered; every text checked."""
    seen, expected = set(), ar_text(reference, 40)
    for _ in range(rounds):
        for response in post_all(url, [body(40)] * 4):
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
            seen.add(response.headers[HEADER])
        if len(seen) == 2:
            break
    return seen


def sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def test_both_replicas_answer_and_greedy_text_equals_the_reference(ray_cluster, reference):
    """Concurrent requests (default mode: mirror) spread over both replicas; every text is the reference's."""
    _, url, _ = ray_cluster
    assert answer_from_both(url, reference) == live_replicas()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=60) as response:
        assert response.status_code == 200 and response.headers[HEADER] in live_replicas()
        lines = sse_lines(response)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    expected = reference.generate([{"role": "user", "content": PROMPT}], mode="ar", max_new_tokens=30).text
    assert text == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs Linux and two cores")
def test_each_replica_runs_on_its_own_core(ray_cluster):
    """One CPU each: the two replica processes are pinned to different cores (every thread, the engine's too)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_replica(p)]
    assert len(pids) == 2
    masks = [{frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")} for pid in pids]
    assert all(len(mask) == 1 for mask in masks)  # every thread of a replica on the same core
    cores = sorted(os.sched_getaffinity(0))
    assert {next(iter(mask)) for mask in masks} == {frozenset({cores[0]}), frozenset({cores[1]})}


def _is_replica(pid: str) -> bool:
    try:
        return f"ServeReplica:{cluster.APP}:{cluster.DEPLOYMENT}" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def test_metrics_of_both_replicas_reach_one_scrape_with_their_label(ray_cluster, reference):
    """Ray's metrics export holds each replica's series under `replica`, names as `ray_mirror_rt_*`."""
    _, url, metrics_url = ray_cluster
    tags = answer_from_both(url, reference)
    from prometheus_client.parser import text_string_to_metric_families

    def by_replica(name: str) -> dict[str, float]:
        found = {}
        for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
            for sample in family.samples:
                if sample.name == name and sample.labels.get("replica") in tags:
                    found[sample.labels["replica"]] = found.get(sample.labels["replica"], 0) + sample.value
        return found

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and set(by_replica("ray_mirror_rt_generation_tokens_total")) != tags:
        time.sleep(0.5)
    tokens = by_replica("ray_mirror_rt_generation_tokens_total")
    assert set(tokens) == tags and all(v >= 40 for v in tokens.values())
    assert set(by_replica("ray_mirror_rt_e2e_request_latency_seconds_count")) == tags
    assert set(by_replica("ray_mirror_rt_spec_decode_num_drafts_total")) == tags  # mirror mode drafts


def test_overload_is_a_503_with_retry_after_from_the_proxy_and_none_is_lost(ray_cluster, reference):
    """More requests than the replicas hold (`max_ongoing_requests` each) and the proxy queues (`max_queued`),
    all sent before any can finish (100 slowed forwards: 2 s at least): the rest are refused at once with a 503,
    every other one gets the reference text, none is lost. Serve counts its queue loosely under a burst: it may
    refuse more than it must, or admit a few more (40 of room 38 + 4 in one CI run), so twice the room is sent
    and at least half the surplus must be refused."""
    settings, url, metrics_url = ray_cluster
    rejected = proxy_retries(metrics_url, REJECTED)
    options = cluster.deployment_options(settings, SERVER)
    room = settings.replicas * options["max_ongoing_requests"] + options["max_queued_requests"]
    surplus = room
    timed = post_timed(url, [body(100, mode="ar")] * (room + surplus))
    responses = [response for response, _, _ in timed]
    codes = [r.status_code for r in responses]
    last_sent = max(sent for _, sent, _ in timed)
    assert last_sent < min(done for r, _, done in timed if r.status_code == 200), "sent after the first answer"
    assert codes.count(200) + codes.count(503) == len(timed), codes
    assert codes.count(200) >= 2 and codes.count(503) >= surplus // 2, codes
    expected = ar_text(reference, 100)
    assert all(r.json()["choices"][0]["text"] == expected for r in responses if r.status_code == 200)
    busy = [r for r in responses if r.status_code == 503]
    assert all(r.headers["retry-after"] == "1" and HEADER not in r.headers for r in busy)
    assert all(r.json()["error"]["message"].startswith("the server is busy") for r in busy)
    deadline = time.monotonic() + 30  # Ray exports its metrics every few seconds
    while proxy_retries(metrics_url, REJECTED) < rejected + len(busy) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proxy_retries(metrics_url, REJECTED) == rejected + len(busy)


def test_a_replica_killed_mid_stream_ends_its_stream_cleanly_and_comes_back(ray_cluster, reference):
    """ray.kill on the replica serving a stream: the stream ends with an error event and [DONE], no hang;
    later requests are served, and Serve starts a new replica."""
    _, url, _ = ray_cluster
    with httpx.stream("POST", url + "/v1/completions", json=body(200, mode="ar", stream=True), timeout=30) as response:
        tag, lines = response.headers[HEADER], response.iter_lines()
        first = next(line for line in lines if line)
        kill_replica(tag)
        rest = [line for line in lines if line]
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == 500 and "lost" in error["message"]
    assert answer_from_both(url, reference) - {tag}  # served at once by the other replica
    assert tag not in wait_two_running({tag})
    assert len(answer_from_both(url, reference)) == 2


def test_a_replica_lost_before_answering_is_retried_with_the_right_answer(ray_cluster, reference, cues):
    """A replica's process exits in the middle of a non-streamed generation: the proxy sends the request
    again, the other replica answers it in full, and the lost replica is replaced."""
    _, url, metrics_url = ray_cluster
    before, retries = live_replicas(), proxy_retries(metrics_url)
    (cues / "crash").touch()
    response = httpx.post(url + "/v1/completions", json=body(80), timeout=60)
    assert not (cues / "crash").exists()  # a replica took the cue
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == ar_text(reference, 80)
    assert response.headers[HEADER] in before  # the replica that did not take the cue
    gone = before - {response.headers[HEADER]}
    assert len(gone) == 1 and not wait_two_running(gone) & gone
    deadline = time.monotonic() + 20
    while proxy_retries(metrics_url) == retries and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proxy_retries(metrics_url) == retries + 1


REJECTED = "ray_mirror_rt_proxy_rejected_total"  # the proxy's 503s: every replica at its limit


def proxy_retries(metrics_url: str, name: str = "ray_mirror_rt_proxy_retries_total") -> float:
    """`name` (the proxy's retries) in Ray's export (0 before the first)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def test_a_dead_engine_thread_fails_the_health_check_and_the_replica_is_replaced(ray_cluster, reference, cues):
    """A replica whose engine thread ended fails check_health; Serve stops it, its request is answered by the
    other replica, and a new replica takes its place."""
    _, url, _ = ray_cluster
    before = live_replicas()
    (cues / "stop").touch()
    response = httpx.post(url + "/v1/completions", json=body(40), timeout=60)
    assert not (cues / "stop").exists()
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == ar_text(reference, 40)
    assert response.headers[HEADER] in before
    gone = before - {response.headers[HEADER]}
    assert len(gone) == 1 and not wait_two_running(gone) & gone


def test_a_replica_that_cannot_be_placed_says_so_in_one_line(ray_cluster):
    """A replica asking for a resource no node has: a one-line ClusterError after the placement timeout."""
    settings, _, _ = ray_cluster
    cluster.check_fits(settings.actor_options, 2)  # the module's own two replicas fit
    with pytest.raises(cluster.ClusterError, match="cannot place 3 replicas"):
        cluster.check_fits(settings.actor_options, 3)
    npu = cluster.ClusterConfig(actor_options={"num_cpus": 0, "resources": {"intel_npu": 1}})
    server = ServerConfig(drain_timeout=1)
    app = cluster.replica_deployment(cluster.deployment_options(npu, server)).bind(server, tiny_engine)
    try:
        with pytest.raises(cluster.ClusterError, match="^a replica cannot be placed: .*intel_npu[^\n]*$"):
            cluster.deploy(app, name="unplaceable", route_prefix="/unplaceable")
    finally:
        serve.delete("unplaceable")


def test_an_engine_that_fails_to_load_fails_the_deploy_in_one_line(ray_cluster):
    """The constructor's error, last line only, instead of Serve's retries and traceback."""
    settings, _, _ = ray_cluster
    broken = cluster.ClusterConfig(actor_options={**settings.actor_options, "num_cpus": 0})
    app = cluster.build(ServerConfig(drain_timeout=1), broken, functools.partial(_fail, "no such model"))
    try:
        with pytest.raises(cluster.ClusterError, match="^the replicas failed to start: .*no such model[^\n]*$"):
            cluster.deploy(app, name="broken", route_prefix="/broken")
    finally:
        serve.delete("broken")


def _fail(message: str):
    raise FileNotFoundError(message)


def test_a_second_server_on_the_same_cluster_is_refused_and_the_first_keeps_serving(ray_cluster, reference):
    """`--ray-address` to a cluster that already serves mirror-rt: redeploying its app under the same name took
    the first server over and deleted it on exit; now it is refused in one line, before anything is deployed."""
    _, url, _ = ray_cluster
    with pytest.raises(cluster.ClusterError, match="^this Ray cluster already serves mirror-rt [^\n]*$"):
        cluster._refuse_a_second_app()
    response = httpx.post(url + "/v1/completions", json=body(8), timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == ar_text(reference, 8)
