"""OpenAI's Responses API (`POST /v1/responses`) as the official client uses it (`responses.create`, its stream
helper), checked against the chat path it runs on: the same text, the same calls, the same usage; the typed
events in order; function tools, a tool loop in `input`, `text.format`, and what it refuses."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import Delayed, Swapped, metric, scrape, start, tiny_engine, wait_for

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOL = {"type": "function", "name": "weather", "description": "the weather in a city", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def server():
    running = start(tiny_engine(max_seq_len=1536), max_queued=4, request_timeout=20)
    yield running
    running.stop()


def chat(server, messages, **kwargs):
    return server.client().chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


def ended_early(server) -> dict:
    """The end of sequence made likely after 3 tokens (the tiny model never ends on its own)."""
    eos = server.state.engine.tokenizer.eos_token_ids[0]
    return {"logit_bias": {str(eos): 100}, "min_tokens": 3}


@pytest.mark.parametrize("max_tokens, status", [(12, "incomplete"), (400, "completed")])
def test_a_text_input_answers_as_the_chat_path(server, max_tokens, status):
    client = server.client()
    extra = ended_early(server) if status == "completed" else {}
    answer = client.responses.create(model="tiny", input="hello there", instructions="be brief",
                                     max_output_tokens=max_tokens, temperature=0, extra_body=extra)
    same = chat(server, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
                max_completion_tokens=max_tokens, extra_body=extra)
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.status == status
    assert answer.output_text == same.choices[0].message.content
    assert [item.type for item in answer.output] == ["message"] and answer.output[0].role == "assistant"
    assert (answer.incomplete_details is not None) == (status == "incomplete")
    assert (answer.usage.input_tokens, answer.usage.output_tokens, answer.usage.total_tokens) == \
        (same.usage.prompt_tokens, same.usage.completion_tokens, same.usage.total_tokens)
    assert answer.instructions == "be brief" and answer.store is False


def test_message_items_with_text_parts_are_the_conversation(server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
             {"role": "user", "content": "and now?"}]
    answer = server.client().responses.create(model="tiny", input=items, max_output_tokens=10, temperature=0)
    same = chat(server, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "and now?"}], max_tokens=10)
    assert answer.output_text == same.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [8, 400])
def test_the_stream_helper_gets_the_whole_answer_and_ordered_events(server, max_tokens):
    client = server.client()
    kwargs = dict(model="tiny", input="hello there", max_output_tokens=max_tokens, temperature=0,
                  extra_body=ended_early(server) if max_tokens > 8 else {})
    whole = client.responses.create(**kwargs)
    assert whole.status == ("incomplete" if max_tokens == 8 else "completed")
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs["extra_body"], "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as raw:
        lines = [line for line in raw.iter_lines() if line]
    named = [line.removeprefix("event: ") for line in lines[::2]]
    assert named == [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "weather"}],
                         ids=["required", "named"])
def test_a_forced_function_call_is_a_function_call_item(server, tool_choice):
    client = server.client()
    kwargs = dict(model="tiny", input="weather in Paris?", tools=[TOOL], tool_choice=tool_choice,
                  max_output_tokens=200, temperature=0)
    answer = client.responses.create(**kwargs)
    chat_choice = {"type": "function", "function": {"name": "weather"}} if isinstance(tool_choice, dict) \
        else tool_choice
    same = chat(server, [{"role": "user", "content": "weather in Paris?"}], tools=[CHAT_TOOL],
                tool_choice=chat_choice, max_tokens=200).choices[0].message.tool_calls
    made = [item for item in answer.output if item.type == "function_call"]
    assert made and [(c.name, c.arguments) for c in made] == [(c.function.name, c.function.arguments) for c in same]
    for call in made:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in made]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [c.arguments for c in made]


def test_a_tool_loop_sends_the_call_and_its_output_back(server):
    """function_call and function_call_output items are the assistant's call and the tool's answer (a chat's)."""
    call_id = "call_abc123"
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": call_id, "name": "weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}]
    answer = server.client().responses.create(model="tiny", input=items, tools=[TOOL], max_output_tokens=16,
                                              temperature=0)
    same = chat(server, [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call_id, "type": "function",
                              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}],
                tools=[CHAT_TOOL], max_tokens=16)
    assert answer.output_text == (same.choices[0].message.content or "")
    unanswered = httpx.post(server.url + "/v1/responses", timeout=30,
                            json={"input": items[:2], "tools": [TOOL], "max_output_tokens": 4})
    assert unanswered.status_code == 400 and unanswered.json()["error"]["param"].startswith("input")


def same_entries(ours, theirs) -> bool:
    """The same tokens with the same log-probabilities and runners-up, to float64's last bits: a request whose
    prompt the prefix cache holds computes its first row alone, and two near-tied runners-up may then swap."""
    assert [(e.token, e.bytes) for e in ours] == [(e.token, e.bytes) for e in theirs]
    for a, b in zip(ours, theirs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-9)
    return True


def test_output_logprobs_are_the_chat_paths(server):
    """include message.output_text.logprobs with top_logprobs: each output token's entry, as the chat path gives
    it; streamed, the deltas carry their own tokens' entries."""
    kwargs = dict(model="tiny", input="hello there", max_output_tokens=6, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    client = server.client()
    answer = client.responses.create(**kwargs)
    same = chat(server, [{"role": "user", "content": "hello there"}], max_tokens=6, logprobs=True, top_logprobs=2)
    entries = answer.output[0].content[0].logprobs
    assert same_entries(entries, same.choices[0].logprobs.content)
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.logprobs for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert same_entries([e for d in deltas for e in d], entries)
    assert same_entries(final.output[0].content[0].logprobs, entries)
    plain = client.responses.create(**{k: v for k, v in kwargs.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs == []


def test_a_json_schema_text_format_is_enforced(server):
    answer = server.client().responses.create(
        model="tiny", input="a city", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(answer.output_text), WEATHER)
    assert answer.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
], ids=["previous response", "a built-in tool", "a reasoning item", "an image", "no tokens", "no input",
        "a string temperature", "background", "include reasoning", "too many top logprobs"])
def test_what_is_refused_is_a_400_naming_the_field(server, body, param):
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"] and "\n" not in error["message"]


def test_a_failure_mid_stream_ends_with_response_failed():
    engine = tiny_engine(max_seq_len=1536)
    running = start(engine, max_queued=4, request_timeout=0.5)
    try:
        with Swapped(engine, "target", lambda t: Delayed(t, 0.05)):
            with httpx.stream("POST", running.url + "/v1/responses", timeout=30,
                              json={"input": "hello", "max_output_tokens": 200, "stream": True,
                                    "ignore_eos": True}) as raw:
                data = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
        assert data[-1]["type"] == "response.failed" and data[-1]["response"]["status"] == "failed"
        assert "timeout" in data[-1]["response"]["error"]["message"]
    finally:
        running.stop()


def test_a_client_leaving_a_stream_stops_its_generation(server):
    """Closing the stream after its first text delta cancels the request at once (not when the collector runs)."""
    engine = server.state.engine
    before = scrape(server.url)
    with Swapped(engine, "target", lambda t: Delayed(t, 0.01)):
        with httpx.stream("POST", server.url + "/v1/responses", timeout=30,
                          json={"input": "hello", "max_output_tokens": 300, "stream": True, "ignore_eos": True,
                                "temperature": 0}) as raw:
            for line in raw.iter_lines():
                if line == "event: response.output_text.delta":
                    break
        assert wait_for(lambda: server.state.scheduler.idle(), timeout=2.0)
    after = scrape(server.url)
    aborted = [metric(s, "request_success_total", finished_reason="abort") for s in (before, after)]
    assert aborted[1] - aborted[0] == 1
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") < 150
