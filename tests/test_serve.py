"""`mirror-rt serve` as clients use it: a real uvicorn server on a free port, the official openai client
(max_retries=0) and raw HTTP where the client hides what matters. Greedy text over HTTP equals the
reference decoder's (`Engine.generate(mode="ar")` on an identical engine) in every mode."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from serve_support import start

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

PROMPT = "hello there"
MESSAGES = [{"role": "user", "content": PROMPT}]


def ar_text(reference, prompt, chat: bool, max_new: int) -> str:
    return reference.generate(prompt, mode="ar", max_new_tokens=max_new, chat=chat).text


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_greedy_chat_and_completion_equal_the_reference(server, reference, mode):
    client = server.client()
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                          extra_body={"mode": mode})
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"mode": mode})
    assert chat.choices[0].message.content == ar_text(reference, MESSAGES, True, 40)
    assert text.choices[0].text == ar_text(reference, PROMPT, False, 40)
    assert chat.model == "tiny" and chat.object == "chat.completion" and text.object == "text_completion"
    extra = chat.model_extra
    assert extra["mirror_rt"]["mode"] == mode
    assert 0 <= extra["timings"]["draft_n_accepted"] <= extra["timings"]["draft_n"]
    assert (extra["timings"]["draft_n"] > 0) == (mode != "ar")
    spec = extra["mirror_rt"]  # the load policy's choice, as this request saw it
    assert 0 <= spec["speculative_steps"] <= spec["steps"] and (spec["speculative_steps"] > 0) == (mode != "ar")
    assert spec["speculated"] == (mode != "ar")  # what ran, beside what was asked (`mode`)
    assert spec["speculative_steps"] + sum(spec["target_only_steps"].values()) == spec["steps"]
    if mode == "ar":
        assert spec["target_only_steps"] == {"asked": spec["steps"]}
        assert spec["why_target_only"].startswith("no speculation: the request asked for target-only decoding")
    assert (spec["mean_gamma"] > 0) == (mode != "ar")


def test_stream_joined_equals_the_answer_and_ends_with_usage(server):
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "timings" in finish[0].model_extra and "mirror_rt" in finish[0].model_extra
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_raw_stream_is_sse_ending_with_done(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-1]


def test_max_completion_tokens_wins_and_counts_exactly(server):
    client = server.client()
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=50,
                                            max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5


def test_a_text_completion_without_max_tokens_makes_16_as_openai_and_vllm_do(server):
    answer = server.client().completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 16
    chat = server.client().chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens > 16  # a chat's limit is the rest of the context


def test_stop_string_cuts_the_text(server, reference):
    """Target-only sampling with a seed is reproducible: the text up to the first stop string, then stop."""
    full = reference.generate(PROMPT, mode="ar", max_new_tokens=40, chat=False, temperature=1.0, seed=3).text
    cut = next(i for i in range(3, len(full) - 2) if full.index(full[i:i + 2]) == i)  # a first occurrence
    stop = full[cut:cut + 2]
    answer = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=1.0,
                                                seed=3, stop=[stop, "never-there"], extra_body={"mode": "ar"})
    assert answer.choices[0].text == full[:cut] and answer.choices[0].finish_reason == "stop"


def test_sampled_request_with_a_seed_repeats(server):
    client = server.client()

    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_top_k_one_samples_the_greedy_text_and_off_samples_freely(server, reference, mode):
    """vLLM's `top_k` extension reaches the sampler (it was dropped as an unknown field): k = 1 leaves one token
    to draw at any temperature; -1 and 0 mean off, as in vLLM."""
    greedy = ar_text(reference, PROMPT, chat=False, max_new=24)

    def sampled(**extra):
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.5, "seed": 3, "mode": mode}
        return httpx.post(server.url + "/v1/completions", json=body | extra, timeout=60).json()["choices"][0]["text"]

    assert sampled(top_k=1) == greedy
    assert sampled(top_k=-1) == sampled(top_k=0) == sampled() != greedy


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_min_p_reaches_the_sampler(server, reference, mode):
    """vLLM's `min_p` (it was a 400): 1 keeps only the likeliest token at any temperature, so the greedy text; 0
    is off."""
    greedy = ar_text(reference, PROMPT, chat=False, max_new=24)

    def sampled(**extra):
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.5, "seed": 3, "mode": mode}
        answer = httpx.post(server.url + "/v1/completions", json=body | extra, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    assert sampled(min_p=1.0) == greedy
    assert sampled(min_p=0.0) == sampled() != greedy


def test_min_tokens_holds_the_end_of_sequence(server, reference):
    """vLLM's `min_tokens` (it was a 400): the end of sequence, biased to come first, comes after that many."""
    eos = reference.tokenizer.eos_token_ids[0]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100}}
    for min_tokens, made in ((None, 1), (0, 1), (5, 6)):
        answer = httpx.post(server.url + "/v1/completions", json=body | {"min_tokens": min_tokens}, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == made and answer["choices"][0]["finish_reason"] == "stop"


def test_disable_spec_decode_and_num_assistant_tokens(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"mode": "mirror", "disable_spec_decode": True})
    assert plain.model_extra["mirror_rt"]["mode"] == "ar" and plain.model_extra["timings"]["draft_n"] == 0
    wide = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"mode": "sd", "num_assistant_tokens": 2})
    assert len(wide.model_extra["mirror_rt"]["acceptance_per_position"]) <= 2
    assert 0 < wide.model_extra["mirror_rt"]["mean_gamma"] <= 2


def test_models_health_version_tokenize(server, reference):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server.url + "/version").json()
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == reference.prompt_ids(PROMPT, chat=False) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == reference.target.max_seq_len
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    named = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert named["token_strs"] == list(PROMPT) and tokens["token_strs"] is None  # the byte tokenizer's names
    bare = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokens["tokens"]  # the byte tokenizer adds nothing around a prompt
    refused = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": "no"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_special_tokens"
    info = httpx.get(server.url + "/tokenizer_info").json()  # vLLM's; lm-evaluation-harness's remote tokenizer
    assert "eos_token" in info and info["chat_template"] is None and info["model_max_length"] == \
        reference.target.max_seq_len
    other = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "model": "other"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    card = client.models.retrieve("tiny")  # GET /v1/models/{id}
    assert (card.id, card.object, card.model_extra["max_model_len"]) == ("tiny", "model", reference.target.max_seq_len)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_text_too_long_by_its_characters_alone_is_refused_unread(server, reference):
    """A prompt whose characters need more tokens than the context holds (a token stands for at most
    `longest_token_chars`) gets vLLM's context-length 400 before it is tokenized: a tokenizer holds the GIL (8 MB
    took 8 s with the default model's, every other request waiting). The same 400 as a tokenized prompt's."""
    context = reference.target.max_seq_len
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * context}]}),
                       ("/v1/completions", {"prompt": "ab" * context}), ("/tokenize", {"prompt": "ab" * context})):
        answer = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=60)
        error = answer.json()["error"]
        assert answer.status_code == 400, answer.text
        assert error["message"].startswith(f"This model's maximum context length is {context} tokens.")
        assert f"your prompt contains at least {2 * context} input tokens" in error["message"]
    fits = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * (context - 8), "max_tokens": 4})
    assert fits.status_code == 200, fits.text


CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
    "name": "f", "arguments": "{}"}}]}
BAD = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None),
    ("nested too deeply", b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b', "messages": []}', 400, None),
    ("no messages", {"model": "tiny"}, 400, "messages"),
    ("wrong type", {"messages": MESSAGES, "max_tokens": "5"}, 400, "max_tokens"),
    ("content of a wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("an image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    ("tool_choice none of the three", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                                       "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("negative max tokens", {"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    ("top_p above 1", {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", {"messages": MESSAGES, "top_k": -2}, 400, "top_k"),
    ("seed beyond int64", {"messages": MESSAGES, "seed": 2**70}, 400, "seed"),
    ("n above 16", {"messages": MESSAGES, "n": 17}, 400, "n"),
    # a union's error from the member that got furthest: it said "Input should be 'none', 'auto' or 'required'"
    ("named tool_choice without its function", {"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, 400,
     "tool_choice.function"),
    ("text part without its text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text"),
    ("user message without content", {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ("user that is no string", {"messages": MESSAGES, "user": 5}, 400, "user"),  # OpenAI refuses both
    ("min_p out of range", {"messages": MESSAGES, "min_p": 2}, 400, "min_p"),
    ("min_tokens below 0", {"messages": MESSAGES, "min_tokens": -1}, 400, "min_tokens"),
    ("include_stop_str_in_output", {"messages": MESSAGES, "include_stop_str_in_output": True}, 400,
     "include_stop_str_in_output"),
    ("continue_final_message", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("stream_options without stream", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("json_schema without its name", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, 400, "response_format.json_schema.name"),
    ("unknown response format", {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("schema llguidance refuses", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400, "response_format"),
    ("bad regex", {"messages": MESSAGES, "structured_outputs": {"regex": "(["}}, 400, "structured_outputs"),
    ("schema that admits nothing", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, 400, "response_format"),
    ("schema with no finite instance", {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                                                  "json_schema": {
        "name": "x", "schema": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                "required": ["c"]}}, "$ref": "#/$defs/n"}}}}, 400, "response_format"),
    ("overlapping oneOf", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, 400, "response_format"),
    ("two constraints", {"messages": MESSAGES, "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a+"}}, 400, "structured_outputs"),
    ("top_logprobs above 20", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logit_bias key", {"messages": MESSAGES, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("penalty out of range", {"messages": MESSAGES, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("tool_choice names no tool", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice"),
    ("tool message without its call", {"messages": [*MESSAGES, {"role": "tool", "content": "4"}]}, 400,
     "messages.1.tool_call_id"),
    ("tool message after no call", {"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c1", "content": "4"}]},
     400, "messages.1.role"),
    ("tool message answering another call", {"messages": [*MESSAGES, CALLED, {
        "role": "tool", "tool_call_id": "c2", "content": "4"}]}, 400, "messages.2.tool_call_id"),
    ("a call left unanswered", {"messages": [*MESSAGES, CALLED, {"role": "user", "content": "and?"}]}, 400,
     "messages.2"),
    ("two tools of one name", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     400, "tools"),
    ("unknown mode", {"messages": MESSAGES, "mode": "fast"}, 400, "mode"),
    ("unknown model", {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
    ("beyond the context", {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 10}, 400,
     "input_tokens"),
]


@pytest.mark.parametrize("case, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_the_envelope(server, case, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"] and error["type"]
    if case == "an image part":
        assert "'image_url' are not supported" in error["message"]
    if case == "overlapping oneOf":  # llguidance's advice names an option no request can set: ours instead
        assert "write anyOf where any may" in error["message"] and "coerce_one_of" not in error["message"]


def test_vllm_extensions_at_their_defaults_are_taken(server):
    """min_tokens 0, include_stop_str_in_output and continue_final_message false (what vLLM clients send
    by default) are served; other values are 400s naming them, never silently ignored."""
    body = {"messages": MESSAGES, "max_tokens": 4, "min_tokens": 0, "include_stop_str_in_output": False,
            "continue_final_message": False}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_stream_null_is_false(server):
    """OpenAI's spec has `stream` nullable, default false (it was a 400: 'Input should be a valid boolean')."""
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": PROMPT})):
        answer = httpx.post(server.url + path, json={**body, "stream": None, "max_tokens": 4}, timeout=30)
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/json", answer.text


def test_a_batch_of_one_token_id_prompt_is_served_as_the_ids(server, reference):
    """OpenAI's `prompt: [[ids]]` (a batch of one prompt of token ids): the same answer as `prompt: ids` (it was a
    400 saying the prompt should be a valid string); longer batches: tests/test_serve_batch_prompts.py."""
    ids = reference.prompt_ids(PROMPT, chat=False)
    answers = [httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
                          timeout=30) for prompt in (ids, [ids])]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


@pytest.mark.parametrize("ids", [[5, "vocab"], [-1, 5]], ids=["past the vocabulary", "negative"])
def test_prompt_ids_outside_the_vocabulary_are_refused_and_leave_a_stream_alone(server, reference, ids):
    """Token ids are checked at the door: an id past the embedding table failed the whole batch's step."""
    vocab = reference.target.vocab_size
    body = {"prompt": [vocab if t == "vocab" else t for t in ids], "max_tokens": 4}
    client = server.client()
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    pieces = [next(stream).choices[0].text]  # running in the batch when the bad request arrives
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and str(vocab - 1) in error["message"] and "\n" not in error["message"]
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == ar_text(reference, PROMPT, chat=False, max_new=40)


@pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["empty text", "no token ids", "an empty list of ids"])
def test_an_empty_completion_prompt_is_a_400(server, prompt):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_context_overflow_uses_vllms_sentence(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 250}],
                                                max_tokens=20)
    assert caught.value.status_code == 400
    message = caught.value.body["message"]
    assert message.startswith("This model's maximum context length is 256 tokens. However, you requested 20 output")
    assert message.endswith("(parameter=input_tokens, value=250)")


def test_unknown_fields_are_ignored_and_unknown_routes_are_enveloped(server):
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "whatever": {"x": 1}})
    assert ok.status_code == 200
    missing = httpx.get(server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_api_key_guards_v1_only(engine):
    guarded = start(engine, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            guarded.client(api_key="wrong").models.list()
        response = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
        assert guarded.client(api_key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert httpx.get(guarded.url + "/metrics").status_code == 200  # never behind the key
        assert httpx.get(guarded.url + "/health").status_code == 200
    finally:
        guarded.stop()


def test_health_is_503_while_loading(engine):
    import threading

    from serve_support import RunningServer

    from mirror_rt.serving.app import ServerConfig, create_app

    release = threading.Event()

    def slow_load():
        release.wait(30)
        return engine

    server = RunningServer(create_app(ServerConfig(), slow_load))
    try:
        for _ in range(100):
            try:
                response = httpx.get(server.url + "/health", timeout=2)
                break
            except httpx.TransportError:
                import time

                time.sleep(0.05)
        assert response.status_code == 503 and response.json()["error"]["type"] == "unavailable_error"
        busy = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and "loading" in busy.json()["error"]["message"]
        release.set()
        server.wait_ready(10)
    finally:
        release.set()
        server.stop()


def test_continuous_usage_counts_tokens_per_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage is the tokens committed so far, so a
    load client can turn chunk gaps into per-token latency."""
    chunks = list(server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].text]
    assert counts == sorted(counts) and counts[-1] <= 30 and len(counts) >= 2
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].choices == []
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].usage.completion_tokens == 30  # every chunk, as in vLLM


def test_device_fallbacks_are_counted_once_per_role():
    from prometheus_client.parser import text_string_to_metric_families

    from mirror_rt.devices.placement import plan
    from mirror_rt.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    placement = plan("ort:cpu", "ort:cpu", "mirror", [0, 1])
    metrics.fallbacks(replace(placement, fallbacks={"target": "cuda"}))
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples
               if s.name == "mirror_rt:device_fallback_total"]
    assert [(s.labels["role"], s.labels["requested"], s.labels["actual"], s.value) for s in samples] == [
        ("target", "cuda", "ort:cpu", 1.0)]
