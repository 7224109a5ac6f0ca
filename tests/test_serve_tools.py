"""Forced tool calls as agent frameworks send them (the tiny engine on a real server, the official openai client):
nested models with `$defs`, functions without parameters, `parallel_tool_calls`, a bad tool schema, vLLM's older
`guided_*` names and a json_schema format without its schema."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import start, tiny_engine

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MESSAGES = [{"role": "user", "content": "book it"}]
PASSENGER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Passenger": PASSENGER}, "type": "object", "required": ["passengers"],
    "properties": {"passengers": {"type": "array", "items": {"$ref": "#/$defs/Passenger"}, "minItems": 1,
                                  "maxItems": 2}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: it takes {}
EMPTY = {"type": "function", "function": {"name": "clear", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server():
    running = start(tiny_engine(max_seq_len=1536), max_queued=4)
    yield running
    running.stop()


def calls(server, **options) -> tuple[list, str]:
    answer = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                     **({"temperature": 0} | options))
    choice = answer.choices[0]
    return choice.message.tool_calls or [], choice.finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "book"}}],
                         ids=["required", "named"])
def test_a_tool_whose_parameters_use_defs_is_called(server, tool_choice):
    """Nested models give `$defs` (openai.pydantic_function_tool does): under `required` they were a 400
    (the pointer did not resolve once the parameters sat inside the array of calls)."""
    made, reason = calls(server, tools=[BOOK, PING], tool_choice=tool_choice)
    assert reason == "tool_calls" and made
    for call in made:
        if call.function.name == "book":
            jsonschema.validate(json.loads(call.function.arguments), BOOK["function"]["parameters"])


@pytest.mark.parametrize("tool", [PING, EMPTY], ids=["omitted", "no properties"])
def test_a_function_without_parameters_gets_empty_arguments(server, tool):
    name = tool["function"]["name"]
    made, reason = calls(server, tools=[tool, BOOK], tool_choice={"type": "function", "function": {"name": name}})
    assert reason == "tool_calls" and [(c.function.name, c.function.arguments) for c in made] == [(name, "{}")]


def test_forced_arguments_hold_no_undeclared_keys(server):
    made, _ = calls(server, tools=[BOOK], tool_choice="required")
    for call in made:
        for passenger in json.loads(call.function.arguments)["passengers"]:
            assert set(passenger) <= {"name", "age"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "book"}}],
                         ids=["required", "named"])
def test_stop_strings_do_not_cut_a_forced_call(server, tool_choice):
    """`passengers` is a key every forced call writes: as a stop string it cut the arguments to invalid JSON under
    finish_reason tool_calls. Forced calls are not cut: the calls equal those made without it."""
    made, reason = calls(server, tools=[BOOK], tool_choice=tool_choice, stop=["passengers"])
    assert reason == "tool_calls" and made
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in made)
    plain, _ = calls(server, tools=[BOOK], tool_choice=tool_choice)
    assert [(c.function.name, c.function.arguments) for c in made] == [
        (c.function.name, c.function.arguments) for c in plain]


def test_parallel_tool_calls_false_makes_at_most_one_call(server):
    many, _ = calls(server, tools=[BOOK, PING, EMPTY], tool_choice="required", temperature=1.0, seed=3)
    one, _ = calls(server, tools=[BOOK, PING, EMPTY], tool_choice="required", temperature=1.0, seed=3,
                   parallel_tool_calls=False)
    assert len(one) == 1 and len(many) >= 1


def test_a_tool_schema_llguidance_cannot_run_is_a_400_naming_the_tool(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "bogus"}}}}}
    for tool_choice in ("auto", "required"):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": MESSAGES, "tools": [PING, bad], "tool_choice": tool_choice})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "tools.1.function.parameters"


@pytest.mark.parametrize("schema, reason", [
    ({"type": "florb"}, "Invalid type: florb"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "required property 'a' is unsatisfiable")],
    ids=["unknown type", "required property false"])
def test_a_schema_gets_its_own_reason_whatever_field_carries_it(server, schema, reason):
    """As response_format it said `the JSON schema has no finite instance ...` where the same schema as tool
    parameters said `Invalid type: florb`: now both give the schema's own fault, the client's BadRequestError."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as as_format:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(openai.BadRequestError) as as_tool:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, tools=[
            {"type": "function", "function": {"name": "f", "parameters": schema}}], tool_choice="required")
    said = [e.value.body["message"] for e in (as_format, as_tool)]
    assert all(reason in message and "finite" not in message for message in said), said
    assert as_format.value.body["param"] == "response_format"
    assert as_tool.value.body["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("field, value, valid", [
    ("guided_choice", ["yes", "no"], lambda text: text in ("yes", "no")),
    ("guided_regex", "[a-c]{3}", lambda text: len(text) == 3 and set(text) <= set("abc")),
    ("guided_json", PASSENGER, lambda text: jsonschema.validate(json.loads(text), PASSENGER) is None),
])
def test_vllms_older_guided_fields_constrain_as_structured_outputs(server, field, value, valid):
    answer = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                                     extra_body={field: value})
    assert valid(answer.choices[0].message.content)
    both = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, field: value, "structured_outputs": {"regex": "a"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "structured_outputs"


def test_a_json_schema_format_without_its_schema_answers_a_json_object(server):
    answer = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                                     response_format={"type": "json_schema",
                                                                      "json_schema": {"name": "x"}})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("template, says", [
    (None, "has no chat template"),
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}",
     "the chat template refused the messages: a system message comes first"),
    ("{{ messages[0]['content'].upper() }}{{ messages[0].nope.deeper }}", "the chat template refused the messages"),
])
def test_a_chat_the_template_cannot_render_is_a_400_naming_messages(tmp_path, template, says):
    """A model without a chat template, or a template that refuses the messages (its raise_exception, a field the
    messages lack), is the client's 400 on `messages`, not a 500."""
    from conftest import write_hf_folder

    from mirror_rt.models.tokenizer import HFTokenizer
    from mirror_rt.serving import protocol, tools
    from mirror_rt.serving.errors import APIError

    folder = write_hf_folder(tmp_path / "m")
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text()) | {"chat_template": template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    req = protocol.parse(protocol.ChatRequest, {"messages": [{"role": "user", "content": "w5"}]})
    with pytest.raises(APIError) as caught:
        tools.prompt_ids(req, HFTokenizer(folder))
    assert caught.value.status == 400 and caught.value.param == "messages" and says in str(caught.value)
