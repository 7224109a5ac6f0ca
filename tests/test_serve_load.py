"""The server under load and misbehaving clients: a full queue answers 503 at once, a client that leaves
(streaming, waiting for a whole answer, or still queued) stops its generation within a step and frees
the engine, a draft fault still gives the right answer, and /metrics adds up."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_support import Delayed, Faulty, Swapped, metric, scrape, start, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("openai")

PROMPT = "hello there"


@pytest.fixture(scope="module")
def server(engine):
    """A batch of one row (so one request runs and the next waits: the admission rules under test) and a queue
    of one."""
    from mirror_rt.runtime.batch.decoder import BatchConfig

    engine.batch = BatchConfig(max_num_seqs=1, adaptive_speculation=False)
    engine.reset()
    running = start(engine, max_queued=1, request_timeout=30)
    yield running
    running.stop()


def ar_text(reference, max_new: int) -> str:
    return reference.generate(PROMPT, mode="ar", max_new_tokens=max_new, chat=False, ignore_eos=True).text


def body(max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}


def idle(server) -> bool:
    samples = scrape(server.url)
    return metric(samples, "num_requests_running") == 0 and metric(samples, "num_requests_waiting") == 0


def test_overload_answers_503_at_once_and_serves_the_admitted(server, engine, reference):
    """max_queued=1: of 5 concurrent requests one runs, one waits, three get 503 with Retry-After at once."""
    results, started = [None] * 5, time.monotonic()

    def call(i):
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body(150), timeout=60)
        results[i] = (r.status_code, time.monotonic() - t0, r)

    with Swapped(engine, "target", lambda t: Delayed(t, 0.02)):  # a request now takes about a second
        before = scrape(server.url)
        threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
            time.sleep(0.03)  # arrival order: the first runs, the second queues
        for t in threads:
            t.join(60)
    codes = sorted(code for code, _, _ in results)
    assert codes == [200, 200, 503, 503, 503], codes
    for code, seconds, response in results:
        if code == 503:
            assert seconds < 1.0 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "ServiceUnavailableError"
            assert "2 of 2 places taken (1 decoding at once, 1 waiting)" in response.json()["error"]["message"]
        else:
            assert response.json()["choices"][0]["text"] == ar_text(reference, 150)
    after = scrape(server.url)
    assert metric(after, "request_rejected_total", reason="queue_full") - metric(
        before, "request_rejected_total", reason="queue_full") == 3
    assert time.monotonic() - started < 30 and wait_for(lambda: idle(server))


def test_stream_disconnect_stops_the_generation(server, engine, reference):
    """Close a stream after 2 chunks: within 2 s nothing runs, abort +1, fewer tokens made than asked."""
    before = scrape(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.01)):
        with httpx.stream("POST", server.url + "/v1/completions", json=body(200, stream=True), timeout=30) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:
                    break
        assert wait_for(lambda: idle(server), timeout=2.0)
    after = scrape(server.url)
    assert metric(after, "request_success_total", finished_reason="abort") - metric(
        before, "request_success_total", finished_reason="abort") == 1
    made = metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total")
    assert 0 < made < 100
    answer = httpx.post(server.url + "/v1/completions", json=body(30), timeout=30).json()
    assert answer["choices"][0]["text"] == ar_text(reference, 30)  # nothing of the cancelled request leaks


def test_disconnect_while_waiting_for_a_whole_answer(server, engine):
    """A non-streamed request whose client times out is cancelled too (the ASGI disconnect event)."""
    before = scrape(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.01)):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body(200), timeout=0.5)
        assert wait_for(lambda: idle(server), timeout=2.0)
    after = scrape(server.url)
    assert metric(after, "request_success_total", finished_reason="abort") - metric(
        before, "request_success_total", finished_reason="abort") == 1
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") < 150


def test_a_queued_request_whose_client_left_never_runs(server, engine):
    before = scrape(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.02)):  # the first runs for about a second
        first = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body(150),
                                                           timeout=60))
        first.start()
        assert wait_for(lambda: metric(scrape(server.url), "num_requests_running") == 1)
        with pytest.raises(httpx.ReadTimeout):  # queued behind the first, then gone
            httpx.post(server.url + "/v1/completions", json=body(40, prompt="another prompt"), timeout=0.3)
        assert wait_for(lambda: metric(scrape(server.url), "num_requests_waiting") == 0, timeout=2.0)
        first.join(60)
    assert wait_for(lambda: idle(server))
    after = scrape(server.url)
    assert metric(after, "request_success_total", finished_reason="abort") - metric(
        before, "request_success_total", finished_reason="abort") == 1
    prompt_tokens = metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total")
    assert prompt_tokens == len(PROMPT)  # only the first request ran (the byte tokenizer: one token a byte)


def test_draft_fault_mid_request_gives_the_full_answer(server, engine, reference):
    before = scrape(server.url)
    with Swapped(engine, "draft", lambda d: Faulty(d, after=4)):
        answer = httpx.post(server.url + "/v1/completions", json=body(40, mode="mirror"), timeout=30).json()
    assert answer["choices"][0]["text"] == ar_text(reference, 40)
    assert answer["usage"]["completion_tokens"] == 40
    assert any("fallback to target-only" in e for e in answer["mirror_rt"]["events"])
    after = scrape(server.url)
    assert metric(after, "draft_faults_total") - metric(before, "draft_faults_total") == 1


def test_engine_failure_mid_stream_is_an_error_event_and_the_server_goes_on(server, engine, reference):
    with Swapped(engine, "target", lambda t: Faulty(t, after=6)):
        with httpx.stream("POST", server.url + "/v1/completions", json=body(40, stream=True, mode="ar"),
                          timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "injected fault" in lines[-2]
    failed = httpx.post(server.url + "/v1/completions", json=body(10), timeout=30)
    assert failed.status_code == 200, failed.text
    assert failed.json()["choices"][0]["text"] == ar_text(reference, 10)


def test_request_timeout_ends_a_long_generation_with_an_error(engine):
    slow = start(engine, request_timeout=0.3)
    try:
        with Swapped(engine, "target", lambda t: Delayed(t, 0.02)):
            response = httpx.post(slow.url + "/v1/completions", json=body(200), timeout=30)
        assert response.status_code == 504 and "timeout" in response.json()["error"]["message"]
        assert wait_for(lambda: idle(slow))
    finally:
        slow.stop()


def test_kv_usage_follows_the_batch_down_to_what_the_prefix_cache_keeps(server):
    """The KV gauge moves at every step, the last one too: the request's rows while it runs, then only the blocks
    the prefix cache kept of it (it read 0.0 while the cache held gigabytes), which its gauges report."""
    with httpx.stream("POST", server.url + "/v1/completions", json=body(60, stream=True), timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # in the batch now
        running = scrape(server.url)
        assert metric(running, "kv_cache_usage_perc") > 0
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert wait_for(lambda: idle(server))
    after = scrape(server.url)
    budget, blocks = metric(after, "kv_cache_budget_bytes"), metric(after, "prefix_cache_blocks")
    assert blocks >= 60 // 16 and metric(after, "prefix_cache_bytes") > 0
    block_bytes = metric(after, "prefix_cache_bytes") / blocks  # the target's KV; the budget counts both models'
    assert 0 < metric(after, "kv_cache_usage_perc") < metric(running, "kv_cache_usage_perc")
    assert metric(after, "prefix_cache_bytes") <= budget / 2 and block_bytes > 0  # --prefix-cache-share 0.5


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_metrics_add_up(server, mode):
    """Counters move exactly as the responses say: tokens, drafts, accepted per position, draft_n sums."""
    before = scrape(server.url)
    answers = [httpx.post(server.url + "/v1/completions", json={**body(n), "mode": mode}, timeout=30).json()
               for n in (12, 25, 40)]
    after = scrape(server.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("generation_tokens_total") == sum(a["usage"]["completion_tokens"] for a in answers)
    assert delta("prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    drafted, accepted = delta("spec_decode_num_draft_tokens_total"), delta("spec_decode_num_accepted_tokens_total")
    assert drafted == sum(a["timings"]["draft_n"] for a in answers) > 0
    assert accepted == sum(a["timings"]["draft_n_accepted"] for a in answers) <= drafted
    positions = {dict(k[1])["position"] for k in after if k[0].endswith("accepted_tokens_per_pos_total")}
    assert sum(delta("spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in positions) == accepted
    assert delta("spec_decode_num_drafts_total") == delta("target_verify_seconds_count") > 0
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("time_to_first_token_seconds_count") == 3 and delta("e2e_request_latency_seconds_count") == 3
    itl = delta("inter_token_latency_seconds_count")
    assert itl <= sum(a["usage"]["completion_tokens"] - 1 for a in answers) + 3  # per token, not per chunk
    assert itl >= sum(a["usage"]["completion_tokens"] - 1 for a in answers) - 3
    if mode == "mirror":
        assert delta("reuse_checks_total") >= delta("reuse_hits_total") >= 0
        assert delta("draft_hidden_seconds_total") >= 0 and delta("draft_step_seconds_count") > 0


def test_bench_serve_client_reports_the_run(server, engine):
    """The load client (evaluation.serve_bench) against this server: every request done, per-token ITL, the
    acceptance from /metrics, and a burst past the queue refused with 503."""
    import asyncio

    from mirror_rt.evaluation.serve_bench import WARMUP_TOKENS, load_run, scrape_totals

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    before = scrape_totals(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.005)):
        report = asyncio.run(load_run(server.url, prompts, [1, 2], 20, burst_size=5, api_key=None,
                                      log=lambda *a: None))
    assert [level["completed"] for level in report["levels"]] == [4, 4]
    # before the levels: the label's answer (8 tokens) and the warm-up at the widest level, unmeasured
    served = scrape_totals(server.url)["generation_tokens_total"] - before.get("generation_tokens_total", 0)
    assert served == 8 + 2 * WARMUP_TOKENS + 2 * 4 * 20 + 20 * report["burst"]["admitted"]
    assert all(level["failed"] == 0 and level["output_throughput"] > 0 for level in report["levels"])
    assert all(level["median_itl_ms"] is not None and level["mean_accepted_length"] >= 1
               for level in report["levels"])
    assert report["burst"]["admitted"] + report["burst"]["refused_503"] == 5
    assert report["burst"]["refused_503"] >= 3 and report["burst"]["other_failures"] == 0


class Exiting:
    """A target whose forward raises SystemExit (the engine thread then ends)."""

    def __init__(self, model):
        self.inner = model

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        raise SystemExit("engine thread ends")

    forward_suffix = forward_rows = forward_last = forward


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_that_dies_answers_its_client_and_health_goes_503(engine):
    """Nothing hangs: the running request gets a 503 saying to retry elsewhere (a replica's proxy does), /health
    turns 503, later requests are refused."""
    dying = start(engine)
    try:
        with Swapped(engine, "target", Exiting):
            response = httpx.post(dying.url + "/v1/completions", json=body(10), timeout=30)
        assert response.status_code == 503 and "SystemExit" in response.json()["error"]["message"]
        assert response.headers["x-mirror-rt-retry"] == "engine-stopped"
        assert wait_for(lambda: httpx.get(dying.url + "/health").status_code == 503)
        later = httpx.post(dying.url + "/v1/completions", json=body(10), timeout=30)
        assert later.status_code == 503 and "engine thread stopped" in later.json()["error"]["message"]
    finally:
        dying.stop()


def test_bench_serve_says_why_requests_failed(server, engine):
    """A level whose requests the server refuses says the server's reason beside the count (it printed only
    '0 done, 4 failed')."""
    import asyncio

    from mirror_rt.evaluation.serve_bench import format_level, load_run

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(2)]
    report = asyncio.run(load_run(server.url, prompts, [1], 10**6, burst_size=0, api_key=None, log=lambda *a: None))
    level = report["levels"][0]
    assert level["completed"] == 0 and level["failed"] == 2
    assert level["failure"].startswith("400 ") and "maximum context length" in level["failure"]
    assert "failed (most often: 400 " in format_level(level)


def test_more_choices_than_places_is_a_400_on_n_even_when_idle(server):
    """n=3 on a server of 2 places (1 row, 1 waiting): a 400 naming n and the limits, not admitted over
    --max-queued (it was, on an idle server: the gauges read 2 waiting of 1, and the next request's 503 said '3 of
    2 places taken'). n=2 fits and is served."""
    assert wait_for(lambda: idle(server))
    too_many = httpx.post(server.url + "/v1/completions", json=body(4, n=3), timeout=60)
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "n" and error["message"].startswith("n=3 needs 3 places at once and this server has 2")
    fits = httpx.post(server.url + "/v1/completions", json=body(4, n=2), timeout=60)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
