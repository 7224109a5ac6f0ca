"""A text completion's `prompt` as a list of prompts (OpenAI's batch form, which lm-evaluation-harness sends with
batch_size > 1): one answer whose choice p x n + i is prompt p's choice i, each equal to the same prompt asked
alone; usage summed; all admitted or none; one failure, disconnect or overload stops the whole request."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import Delayed, Swapped, metric, scrape, start, wait_for

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

PROMPTS = ["hello there", "a second, longer prompt of the batch", "three"]


def alone(server, prompt, **kwargs):
    return server.client().completions.create(model="tiny", prompt=prompt, **kwargs)


def idle(server) -> bool:
    samples = scrape(server.url)
    return metric(samples, "num_requests_running") == 0 and metric(samples, "num_requests_waiting") == 0


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_each_prompt_of_a_batch_answers_as_it_would_alone(server, reference, mode):
    kwargs = dict(max_tokens=12, temperature=0, extra_body={"mode": mode})
    batch = alone(server, PROMPTS, **kwargs)
    singles = [alone(server, prompt, **kwargs) for prompt in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.choices[0].text == reference.generate(PROMPTS[0], mode="ar", max_new_tokens=12, chat=False).text
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(batch.usage, field) == sum(getattr(s.usage, field) for s in singles)
    figures = batch.model_extra["mirror_rt"]["prompts"]
    assert [f["mode"] for f in figures] == [mode] * 3 and [f["timings"]["prompt_n"] for f in figures] == \
        [s.usage.prompt_tokens for s in singles]


def test_token_id_prompts_with_n_choices_are_indexed_prompt_by_prompt(server, reference):
    """Two prompts of ids, n=2, sampled with a seed: choices 0-1 are the first prompt's, 2-3 the second's, each
    pair the same as that prompt's request alone (a shuffled mapping would fail here)."""
    ids = [reference.prompt_ids(p, chat=False) for p in PROMPTS[:2]]
    kwargs = dict(max_tokens=10, temperature=1.0, seed=7, n=2)
    batch = alone(server, ids, **kwargs)
    singles = [alone(server, p, **kwargs) for p in ids]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
    assert len({c.text for c in batch.choices}) > 1


def test_a_streamed_batch_carries_every_prompt_and_ends_once(server):
    kwargs = dict(max_tokens=12, temperature=0)
    whole = alone(server, PROMPTS, **kwargs)
    texts, finishes, usages = {}, {}, []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True},
                            **kwargs}) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
        if chunk.get("usage"):
            usages.append(chunk["usage"])
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usages == [whole.usage.model_dump(exclude_none=True)]  # one usage chunk, summed over the prompts
    assert not json.loads(lines[-2][6:])["choices"]


def test_a_batch_scores_each_prompt_as_lm_eval_asks(server):
    """lm-evaluation-harness's loglikelihood payload: echo, logprobs 1, max_tokens 0 or 1, a list of prompts."""
    for max_tokens in (0, 1):
        kwargs = dict(max_tokens=max_tokens, temperature=0, echo=True, logprobs=1)
        batch = alone(server, PROMPTS, **kwargs)
        singles = [alone(server, prompt, **kwargs).choices[0] for prompt in PROMPTS]
        assert [c.index for c in batch.choices] == [0, 1, 2]
        for got, expected in zip(batch.choices, singles):
            assert got.text == expected.text and got.text.startswith(PROMPTS[got.index])
            assert got.logprobs.token_logprobs == expected.logprobs.token_logprobs
        streamed = list(alone(server, PROMPTS, stream=True, **kwargs))
        texts = {}
        for chunk in streamed:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {c.index: c.text for c in batch.choices}


def test_one_bad_prompt_refuses_the_whole_batch_and_runs_none(server, reference):
    vocab = reference.target.vocab_size
    good = reference.prompt_ids(PROMPTS[0], chat=False)
    before = scrape(server.url)
    cases = {"an id past the vocabulary": [good, [5, vocab]], "an empty prompt": ["hello", ""],
             "an empty id list": [good, []]}
    for case, prompts in cases.items():
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 4}, timeout=30)
        assert answer.status_code == 400, (case, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "prompt" and "\n" not in error["message"], case
    assert "prompt 1 is empty" in answer.json()["error"]["message"]
    after = scrape(server.url)
    assert metric(after, "generation_tokens_total") == metric(before, "generation_tokens_total")


def test_a_batch_larger_than_the_server_is_a_400_and_one_that_does_not_fit_now_a_503(engine):
    """Places are the batch's rows plus the queue: more prompts x n than that can never run (400); fewer, but more
    than are free, wait for nobody (503, nothing admitted: the running request alone finishes)."""
    from dataclasses import replace

    saved = engine.batch
    engine.batch = replace(saved, max_num_seqs=2)
    running = start(engine, max_queued=1)
    try:
        answer = httpx.post(running.url + "/v1/completions", json={"prompt": PROMPTS * 2, "max_tokens": 4},
                            timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
        assert "6 prompts x n=1 needs 6 places" in answer.json()["error"]["message"]
        with Swapped(engine, "target", lambda t: Delayed(t, 0.01)):
            stream = running.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=60,
                                                         temperature=0, stream=True)
            next(stream)
            busy = httpx.post(running.url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 4},
                              timeout=30)
            assert busy.status_code == 503 and "Retry-After" in busy.headers
            assert "3 prompts x n=1 need 3" in busy.json()["error"]["message"]
            assert metric(scrape(running.url), "num_requests_waiting") == 0
            list(stream)
        assert running.state.scheduler.idle()
    finally:
        running.stop()
        engine.batch = saved


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_client_leaving_a_batch_stops_every_prompt(server, engine, streamed):
    body = {"prompt": PROMPTS, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": streamed}
    before = scrape(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.01)):
        if streamed:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert wait_for(lambda: idle(server), timeout=3.0)
    after = scrape(server.url)
    aborted = [metric(s, "request_success_total", finished_reason="abort") for s in (before, after)]
    assert aborted[1] - aborted[0] == len(PROMPTS)
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") < 3 * 150
