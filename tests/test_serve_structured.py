"""Structured output, tool calls, logprobs, n and penalties over HTTP (the tiny engine on a real server, the
official openai client with max_retries=0, raw SSE where the client hides what matters): greedy answers
equal the engine's constrained `ar` in every mode, every structured answer validates, and the shapes are
OpenAI's."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import metric, scrape, tiny_engine
from test_token_rules import SCHEMAS

from mirror_rt.runtime.grammar import Constraint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MESSAGES = [{"role": "user", "content": "hello there"}]
MODES = ["ar", "sd", "mirror"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMAS[1]}}
SCORE = {"type": "function", "function": {"name": "score", "parameters": SCHEMAS[0]}}


@pytest.fixture(scope="module")
def engine():
    """The tiny engine with room for the tool prompt (the server describes tools in a system message)."""
    return tiny_engine(max_seq_len=1536)


@pytest.fixture(scope="module")
def reference():
    return tiny_engine(max_seq_len=1536)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_answers_equal_constrained_ar_and_validate(server, reference, mode):
    client = server.client()
    for schema in SCHEMAS:
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                                response_format=schema_format(schema), extra_body={"mode": mode})
        text = answer.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        expected = reference.generate(MESSAGES, mode="ar", max_new_tokens=120, temperature=0,
                                      constraint=Constraint.json_schema(schema)).text
        assert text == expected and answer.choices[0].finish_reason == "stop"


def test_response_format_on_text_completions(server, reference):
    """vLLM takes `response_format` on /v1/completions too (it was ignored there, an invalid schema included)."""
    schema = SCHEMAS[0]
    answer = server.client().completions.create(model="tiny", prompt="pick", max_tokens=120, temperature=0,
                                                extra_body={"response_format": schema_format(schema)})
    jsonschema.validate(json.loads(answer.choices[0].text), schema)
    expected = reference.generate("pick", mode="ar", max_new_tokens=120, temperature=0, chat=False,
                                  constraint=Constraint.json_schema(schema)).text
    assert answer.choices[0].text == expected
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "pick", "response_format": bad}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("field, value, pattern", [
    ("regex", r"[a-c]{2}-[0-9]{2}", r"[a-c]{2}-[0-9]{2}"),
    ("choice", ["left", "right"], r"left|right"),
    ("grammar", 'start: "<" ("x" | "y") ">"', r"<[xy]>"),
])
def test_vllm_structured_outputs(server, field, value, pattern):
    import re

    texts = {server.client().completions.create(model="tiny", prompt="pick", max_tokens=20, temperature=0,
                                                extra_body={"mode": mode, "structured_outputs": {field: value}}
                                                ).choices[0].text for mode in MODES}
    assert len(texts) == 1 and re.fullmatch(pattern, texts.pop())


def test_logprobs_chat_shape_and_equal_in_every_mode(server):
    client = server.client()
    runs = [client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"mode": mode})
            for mode in MODES]
    content = runs[0].choices[0].logprobs.content
    joined = bytes(b for entry in content for b in entry.bytes).decode(errors="replace")
    assert joined == runs[0].choices[0].message.content
    assert len(content) == runs[0].usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob and bytes(e.bytes).decode(errors="replace") == e.token
               for e in content)
    for run in runs[1:]:
        other = run.choices[0].logprobs.content
        assert [e.token for e in other] == [e.token for e in content]
        assert all(abs(a.logprob - b.logprob) < 1e-9 for a, b in zip(other, content))


def test_logprobs_streamed_equal_the_whole_answer(server):
    client = server.client()
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=15, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=15, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    logprobs = whole.choices[0].logprobs
    assert streamed == logprobs.tokens and len(logprobs.tokens) == whole.usage.completion_tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset == sorted(offsets) and offsets[0] == 0  # serve_echo: their values
    assert all(len(top) >= 2 and logprobs.tokens[i] in top for i, top in enumerate(logprobs.top_logprobs))


def test_seeded_sampled_n3_repeats_exactly_and_greedy_choices_are_identical(server):
    client = server.client()

    def texts(**kw):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=25, n=3, **kw)
        assert [c.index for c in answer.choices] == [0, 1, 2]
        return [c.message.content for c in answer.choices], answer.usage.completion_tokens

    sampled, tokens = texts(temperature=1.0, seed=5)
    assert texts(temperature=1.0, seed=5) == (sampled, tokens) and len(set(sampled)) > 1
    single = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=25, temperature=1.0, seed=5)
    assert single.choices[0].message.content == sampled[0]  # choice 0 keeps the request's seed
    greedy, _ = texts(temperature=0)
    assert len(set(greedy)) == 1


def test_n_streamed_carries_every_index(server):
    chunks = list(server.client().completions.create(model="tiny", prompt="hi", max_tokens=8, n=2, temperature=0,
                                                     stream=True))
    text = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text[0] == text[1] and sorted(f.index for f in finishes) == [0, 1]


def test_named_and_required_tool_choice_enforce_a_call(server):
    client = server.client()
    for mode in MODES:
        named = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                               tools=[WEATHER, SCORE], extra_body={"mode": mode},
                                               tool_choice={"type": "function", "function": {"name": "score"}})
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name == "score" and call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[0])
    required = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                                              tools=[WEATHER, SCORE], tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        schema = SCHEMAS[1] if call.function.name == "get_weather" else SCHEMAS[0]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_tool_call_sends_id_and_name_first(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "stream": True,
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"]["tool_calls"][0] for e in events
              if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    assert deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS[1])
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"


def test_tool_results_come_back_in_the_conversation(server):
    """An assistant message with tool_calls (content null) and a tool message are accepted and rendered."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"color": "red", "name": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = server.client().chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=5)
    assert answer.choices[0].message.role == "assistant"
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    prompt = bytes(i - 2 for i in ids if 2 <= i < 258).decode()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"color": "red", "name": "Paris"}}' in prompt
    assert '"name": "get_weather"' in prompt.split("<tools>")[1] and prompt.endswith("sunny")


def test_auto_parses_hermes_tags_or_a_whole_call():
    from mirror_rt.serving.tools import parse_calls

    names = ("get_weather",)
    content, calls = parse_calls('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                 '</tool_call>', names, "auto")
    assert content == "Sure." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert parse_calls('{"name": "get_weather", "parameters": {}}', names, "auto")[0] is None
    assert parse_calls('{"name": "other", "arguments": {}}', names, "auto") == (
        '{"name": "other", "arguments": {}}', [])
    assert parse_calls("just text", names, "auto") == ("just text", [])


def test_required_calls_cut_by_the_budget_keep_what_was_written():
    """A `required` answer cut short by max_tokens: its whole calls, and the cut one with its arguments so far
    (a named function's cut answer is its partial arguments too); no call named yet is no call, and the grammar's
    array is never content."""
    from mirror_rt.serving.tools import parse_calls

    names = ("f", "g")
    whole = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert [c["function"] for c in parse_calls(whole, names, "required")[1]] == [
        {"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}]
    content, calls = parse_calls('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "x', names,
                                 "required")
    assert content is None and [c["function"] for c in calls] == [
        {"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": '{"b": "x'}]
    content, calls = parse_calls('[{"name": "f", "param', names, "required")
    assert content is None and [c["function"] for c in calls] == [{"name": "f", "arguments": ""}]
    assert parse_calls('[{"name": "', names, "required") == (None, [])
    assert parse_calls('[', names, "required") == (None, [])
    one = parse_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}'
                      '</tool_call>', names, "auto", parallel=False)[1]
    assert [c["function"]["name"] for c in one] == ["f"]  # parallel_tool_calls false: the first call


def test_penalties_and_bias_over_http_are_lossless(server):
    client = server.client()
    options = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {str(ord("e") + 2): 5},
               "extra_body": {"repetition_penalty": 1.2}}
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=30, temperature=0).choices[0].text
    texts = {client.completions.create(model="tiny", prompt="hello", max_tokens=30, temperature=0, **{
        **options, "extra_body": {**options["extra_body"], "mode": mode}}).choices[0].text for mode in MODES}
    assert len(texts) == 1 and texts.pop() != plain


def test_constrained_requests_are_counted_by_kind(server):
    before = scrape(server.url)
    server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                            response_format=schema_format(SCHEMAS[0]))
    server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                            tools=[SCORE], tool_choice="required")
    after = scrape(server.url)
    for kind in ("json_schema", "tools"):
        count = metric(after, "constrained_requests_total", kind=kind) - metric(before, "constrained_requests_total",
                                                                                 kind=kind)
        assert count == 1


def test_a_strict_json_schema_closes_its_objects():
    """`strict: true` is OpenAI's strict reading: objects take only the properties they declare where the schema
    leaves it unsaid (a strict schema without `additionalProperties: false` produced `{"x": 30, "y": "cat"}`);
    not strict, the schema is enforced as sent."""
    from mirror_rt.serving import protocol, structured

    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "inner": {
        "type": "object", "properties": {"b": {"type": "boolean"}}}}, "required": ["x"]}
    for strict, closed in ((True, False), (False, None), (None, None)):
        body = {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": schema, "strict": strict}}}
        constraint, kind, param = structured.constraint_of(protocol.parse(protocol.ChatRequest, body))
        sent = json.loads(constraint.spec)
        assert (kind, param) == ("json_schema", "response_format")
        assert sent.get("additionalProperties") is closed
        assert sent["properties"]["inner"].get("additionalProperties") is closed
    assert "additionalProperties" not in schema  # the request's own schema is left as sent


def test_a_strict_schemas_allof_parts_stay_open():
    """The parts of an allOf (and the schema holding it, and their alternatives) are not closed: each would refuse
    the keys the others declare (a strict allOf of {a} and {b} was refused as unsatisfiable); objects inside them
    are."""
    from mirror_rt.serving.tool_schema import closed

    part = {"type": "object", "properties": {"a": {"type": "integer"}, "deep": {
        "type": "object", "properties": {"z": {"type": "boolean"}}}}, "required": ["a"]}
    schema = {"properties": {"c": {"type": "integer"}}, "allOf": [part, {"anyOf": [
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}]}
    sent = closed(schema)
    assert "additionalProperties" not in sent and "additionalProperties" not in sent["allOf"][0]
    assert "additionalProperties" not in sent["allOf"][1]["anyOf"][0]
    assert sent["allOf"][0]["properties"]["deep"]["additionalProperties"] is False
