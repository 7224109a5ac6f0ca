"""`echo` on text completions, as lm-evaluation-harness uses it: the prompt's text and its tokens' raw
log-probabilities before the completion; `max_tokens: 0` gives the prompt alone."""

from __future__ import annotations

import httpx
import pytest
from serve_support import metric, scrape

from mirror_rt.runtime.logprobs import token_logprobs

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

PROMPT = "hello there"


def test_echo_puts_the_prompt_before_the_completion(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_prompt_logprobs_are_the_targets_own(server, engine):
    """Every prompt token's log-probability equals the target's after the tokens before it (none for the first);
    the generated tokens follow with their offsets."""
    ids = engine.prompt_ids(PROMPT, chat=False)
    answer = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                                echo=True, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(ids) + 4 and "".join(logprobs.tokens) == answer.choices[0].text
    cache = engine.target.new_cache(len(ids) + 1)
    expected = token_logprobs(engine.target.forward(ids, cache), ids[1:], 2)
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in expected], abs=1e-6)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server, engine):
    ids = engine.prompt_ids(PROMPT, chat=False)
    answer = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids) and answer.usage.completion_tokens == 0
    chunks = list(server.client().completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == engine.tokenizer.decode(ids)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_max_tokens_zero_with_echo_is_a_request_served(server, engine):
    """No generation runs, yet the server counts it: a finished request and its prompt tokens in /metrics."""
    ids = engine.prompt_ids(PROMPT, chat=False)
    before = scrape(server.url)
    server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    after = scrape(server.url)
    ended = [metric(s, "request_success_total", finished_reason="length") for s in (before, after)]
    prompts = [metric(s, "prompt_tokens_total") for s in (before, after)]
    assert ended[1] - ended[0] == 1 and prompts[1] - prompts[0] == len(ids)


def test_text_offsets_index_the_text_when_a_character_spans_tokens(server):
    """A character of several bytes (a token each here) starts where its first token does and counts once whole:
    the offsets index the text, and the first generated token's is the prompt's length (a running sum of the
    tokens' texts, U+FFFD for each piece, drifted past the end)."""
    prompt = "a\U0001F389\u00e9"  # 1 + 4 + 2 bytes
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0)
    whole = server.client().completions.create(**kwargs)
    offsets = whole.choices[0].logprobs.text_offset
    assert offsets[:8] == [0, 1, 1, 1, 1, 2, 2, 3] and all(o <= len(whole.choices[0].text) for o in offsets)
    chunks = list(server.client().completions.create(**kwargs, stream=True))
    assert [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] \
        == offsets
