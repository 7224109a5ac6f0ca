"""/metrics while answers stream (a real server on a free port, the official openai client): token counters, time to
first token and inter-token latency move as the tokens are committed, as vLLM's do per step, and add up to the
answers' usage at the end (they stayed put for a whole 8 s stream, then jumped by 300)."""

from __future__ import annotations

import pytest
from serve_support import Delayed, metric, scrape, start, tiny_engine

pytest.importorskip("fastapi")
pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    engine.target = Delayed(engine.target, 0.01)  # a 120-token answer takes over a second
    running = start(engine)
    yield running
    running.stop()


def figures(url: str) -> dict:
    samples = scrape(url)
    out = {name: metric(samples, name) for name in (
        "generation_tokens_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count")}
    out["request_success_total"] = sum(metric(samples, "request_success_total", finished_reason=reason)
                                       for reason in ("stop", "length", "abort", "error"))
    return out


def test_counters_move_while_the_stream_runs_and_add_up_at_its_end(server):
    before = figures(server.url)
    stream = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=120, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "mode": "ar"})
    seen, usage = [], None
    for index, chunk in enumerate(stream):
        if index in (10, 40, 80):  # mid-answer: what a scrape sees now
            seen.append({k: v - before[k] for k, v in figures(server.url).items()})
        usage = chunk.usage or usage
    after = {k: v - before[k] for k, v in figures(server.url).items()}
    assert len(seen) == 3 and usage.completion_tokens == 120
    tokens = [s["generation_tokens_total"] for s in seen]
    assert 0 < tokens[0] < tokens[1] < tokens[2] < 120, tokens  # it moved with the stream
    assert all(s["time_to_first_token_seconds_count"] == 1 and s["prompt_tokens_total"] == usage.prompt_tokens
               for s in seen)  # TTFT at the first token, not at the end
    assert 0 < seen[0]["inter_token_latency_seconds_count"] < seen[2]["inter_token_latency_seconds_count"]
    assert all(s["request_success_total"] == 0 for s in seen)  # the request itself ends once
    assert after["generation_tokens_total"] == usage.completion_tokens and after["request_success_total"] == 1
    assert after["inter_token_latency_seconds_count"] == usage.completion_tokens - 1  # one per token after the first
    assert after["time_to_first_token_seconds_count"] == 1


def test_n_choices_and_speculation_add_up_too(server):
    """Two choices decoding speculatively together: the tokens counted step by step equal their usage."""
    before = figures(server.url)
    answer = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "two"}], max_tokens=40, temperature=0.8, seed=3, n=2,
        extra_body={"mode": "mirror"})
    after = {k: v - before[k] for k, v in figures(server.url).items()}
    assert after["generation_tokens_total"] == answer.usage.completion_tokens
    assert after["prompt_tokens_total"] == answer.usage.prompt_tokens
    assert after["time_to_first_token_seconds_count"] == 1


def test_ttft_and_latency_count_from_arrival(server, monkeypatch):
    """Parsing, templating and compiling the grammar are part of a request's wait: with 0.6 s spent compiling it,
    TTFT, queue time and end-to-end latency each hold those 0.6 s (they started after the compile: a 40-field
    json_schema's first chunk came at 1,170 ms and its TTFT histogram said 377 ms less)."""
    import time

    from mirror_rt.serving import structured

    compile_s = 0.6
    checked = structured.checked

    def slow_compile(*args, **kwargs):
        time.sleep(compile_s)
        return checked(*args, **kwargs)

    monkeypatch.setattr(structured, "checked", slow_compile)
    names = ("time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum", "request_queue_time_seconds_sum")
    before = {name: metric(scrape(server.url), name) for name in names}
    answer = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=4, temperature=0,
        response_format={"type": "json_object"})
    samples = scrape(server.url)
    spent = {name: metric(samples, name) - before[name] for name in names}
    assert answer.choices[0].message.content is not None
    assert all(seconds >= compile_s for seconds in spent.values()), spent
