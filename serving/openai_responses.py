"""OpenAI's Responses API (`POST /v1/responses`) over the chat path.

A request becomes a chat request (input items to messages, `instructions` to a system message, `text.format` to
`response_format`, flat function tools to chat tools, `max_output_tokens` to `max_completion_tokens`, mirror-rt's
and vLLM's sampling extensions as they are), runs as one, and its answer is reshaped: a `response` object whose
output holds a message of `output_text` and any function calls, or, streamed, the Responses API's typed events
(`response.created` ... `response.completed`, whose response says `incomplete` when cut by max_output_tokens,
as vLLM's; or `response.failed`). Stateless: nothing is stored, so `previous_response_id` and `background` are 400s
(send the whole conversation in `input`) and every response says `store: false`.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import Field, field_validator

from mirror_rt.serving import protocol
from mirror_rt.serving.errors import APIError
from mirror_rt.serving.protocol import Strict
from mirror_rt.serving.responses import now

# request fields that pass to the chat request as they are (the chat path validates them)
PASSED = ("model", "temperature", "top_p", "seed", "stop", "top_k", "min_p", "min_tokens", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "mode", "num_assistant_tokens",
          "disable_spec_decode", "sampling_verify", "ignore_eos", "parallel_tool_calls", "user", "stream")
LOGPROBS = "message.output_text.logprobs"  # the one `include` served: the output tokens' log-probabilities
# where a chat field's error points in a Responses request
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "tools": "tools", "tool_choice": "tool_choice"}


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return protocol.text_parts_only(content, ("input_text", "output_text", "text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


ITEMS = {"message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutput}


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    store: bool | None = None  # taken; nothing is stored (every response says store: false)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # only LOGPROBS
    top_logprobs: int | None = Field(None, ge=0, le=protocol.MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None

    def refuse_unsupported(self) -> None:
        for param, failed, message in (
                ("previous_response_id", self.previous_response_id is not None,
                 "previous_response_id is not supported: this server stores no responses; send the whole "
                 "conversation in input"),
                ("background", bool(self.background), "background responses are not supported"),
                ("truncation", self.truncation == "auto", "truncation 'auto' is not supported (a conversation "
                                                          "longer than the context is a 400)"),
                ("include", bool(set(self.include or ()) - {LOGPROBS}),
                 f"include takes only '{LOGPROBS}' here (this server has no built-in tools or reasoning)")):
            if failed:
                raise APIError(400, message, param)

    def items(self) -> list:
        """The input as typed items (a string is one user message); a 400 naming an item this server cannot read."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return [_item(i, raw) for i, raw in enumerate(self.input)]

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, raw in enumerate(self.tools or ()):
            kind = raw.get("type")
            if kind != "function":
                raise APIError(400, f"tools[{i}] is of type '{kind}': only function tools are supported",
                               f"tools.{i}.type")
            tools.append(protocol.parse_as(FunctionTool, raw, f"tools.{i}"))
        return tools


def _item(i: int, raw) -> InputMessage | FunctionCallItem | FunctionCallOutput:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in ITEMS:
        what = f"of type {json.dumps(kind)}" if isinstance(raw, dict) else "that is not an object"
        raise APIError(400, f"input[{i}] is an item {what}: messages, function_call and function_call_output are "
                            f"supported", f"input.{i}")
    return protocol.parse_as(ITEMS[kind], raw, f"input.{i}")


def parse(body) -> tuple[ResponsesRequest, protocol.ChatRequest]:
    """The Responses request and the chat request it runs as; a 400 naming the Responses field otherwise."""
    req = protocol.parse_as(ResponsesRequest, body)
    req.refuse_unsupported()
    chat = {name: body[name] for name in PASSED if name in body}
    chat["messages"] = _messages(req)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.function_tools()]
    if req.tool_choice is not None:
        chat["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str)
                               else {"type": "function", "function": {"name": req.tool_choice.name}})
    if req.text is not None and req.text.format is not None:
        chat["response_format"] = _response_format(req.text.format)
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    if LOGPROBS in (req.include or ()):  # the chat path's entries are the Responses API's too
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs or 0
    try:
        return req, protocol.parse(protocol.ChatRequest, chat)
    except APIError as exc:
        raise APIError(exc.status, exc.message, _param(exc.param), exc.headers) from None


def _messages(req: ResponsesRequest) -> list[dict]:
    """Chat messages of the input: consecutive function calls are one assistant message's tool calls."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in req.items():
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def _response_format(text_format: TextFormat) -> dict:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = {"name": text_format.name or "response", "schema": text_format.schema_,
              "description": text_format.description, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    rest = rest.replace(".function.", ".") if head == "tools" else rest  # chat tools nest what Responses flattens
    return PARAMS.get(head, head) + ("." + rest if rest and head not in ("messages", "response_format") else "")


class ResponseShape:
    """A chat answer reshaped as a Responses API answer: `body` for a whole one, `events` for a stream."""

    def __init__(self, req: ResponsesRequest, chat: protocol.ChatRequest, model_name: str):
        self.model_name = model_name
        self.id, self.created = f"resp_{uuid.uuid4().hex}", now()
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.settings = _settings(req, chat)

    def response(self, status: str, output: list, usage: dict | None = None, **extra) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": extra.pop("error", None),
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model_name, "output": output, **self.settings,
                "usage": _usage(usage) if usage else None, **extra}

    def message(self, text: str, status: str, logprobs: list | None = None) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_output_text(text, logprobs)]}

    def body(self, chat_body: dict) -> dict:
        """The whole answer from the chat path's body."""
        choice = chat_body["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        calls = [_call_item(call, "completed") for call in choice["message"].get("tool_calls") or ()]
        content = choice["message"].get("content")
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output = ([self.message(content or "", status, logprobs)] if content or not calls else []) + calls
        return self.response(status, output, chat_body["usage"], mirror_rt=chat_body.get("mirror_rt"))

    async def events(self, chunks):
        """The Responses stream's events from the chat path's SSE chunks."""
        stream = _EventStream(self)
        try:
            yield stream.event("response.created", response=self.response("in_progress", []))
            yield stream.event("response.in_progress", response=self.response("in_progress", []))
            async for raw in chunks:
                data = raw.decode().removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                for event in stream.take(json.loads(data)):
                    yield event
            for event in stream.finish():
                yield event
        finally:  # the client went away (or the stream ended): the chat stream's own cleanup cancels the job now
            await chunks.aclose()


class _EventStream:
    """The output items of one streamed response as they open, grow and close."""

    def __init__(self, shape: ResponseShape):
        self.shape, self.sequence = shape, 0
        self.output: list[dict] = []  # finished items
        self.text: str | None = None  # the message's text while it is open
        self.logprobs: list = []  # its tokens' log-probabilities, when asked
        self.call: dict | None = None  # the function call being streamed
        self.finish_reason, self.usage, self.figures, self.error = None, None, None, None

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def take(self, chunk: dict) -> list[bytes]:
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        if chunk.get("usage") is not None and not chunk["choices"]:
            self.usage, self.figures = chunk["usage"], chunk.get("mirror_rt")
            return []
        events = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content") or logprobs:
                events += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _open_text(self) -> list[bytes]:
        if self.text is not None:
            return []
        self.text = ""
        index, item_id = len(self.output), self.shape.message_id
        return [self.event("response.output_item.added", output_index=index,
                           item=self.shape.message("", "in_progress")),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=_output_text(""))]

    def _text(self, piece: str, logprobs: list) -> list[bytes]:
        events = self._open_text()
        self.text += piece
        self.logprobs += logprobs
        events.append(self.event("response.output_text.delta", item_id=self.shape.message_id,
                                 output_index=len(self.output), content_index=0, delta=piece, logprobs=logprobs))
        return events

    def _call(self, call: dict) -> list[bytes]:
        if call.get("id"):  # a new call: its id and name (the chat path sends them first)
            events = self._close_text() + self._close_call()
            self.call = _call_item({"id": call["id"], "function": {"name": call["function"]["name"],
                                                                    "arguments": ""}}, "in_progress")
            return events + [self.event("response.output_item.added", output_index=len(self.output),
                                        item=self.call)]
        piece = call["function"]["arguments"]
        self.call["arguments"] += piece
        return [self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                           output_index=len(self.output), delta=piece)]

    def _close_text(self, status: str = "completed") -> list[bytes]:
        if self.text is None:
            return []
        index, item_id, text, logprobs = len(self.output), self.shape.message_id, self.text, self.logprobs
        item = self.shape.message(text, status, logprobs)
        self.output.append(item)
        self.text = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=logprobs),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=_output_text(text, logprobs)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _close_call(self) -> list[bytes]:
        if self.call is None:
            return []
        index, item = len(self.output), {**self.call, "status": "completed"}
        self.output.append(item)
        self.call = None
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self) -> list[bytes]:
        shape = self.shape
        if self.error is not None:
            error = {"code": str(self.error.get("code")), "message": self.error.get("message", "")}
            return [self.event("response.failed", response=shape.response("failed", self.output, error=error))]
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._open_text() if self.call is None and not self.output else []  # nothing said: an empty message
        events += self._close_text(status) + self._close_call()
        response = shape.response(status, self.output, self.usage, mirror_rt=self.figures)
        # vLLM's choice: `response.completed` ends every finished stream, a cut one carrying status incomplete
        # (the openai client's stream helpers wait for that event; OpenAI sends `response.incomplete` instead)
        return events + [self.event("response.completed", response=response)]


def _settings(req: ResponsesRequest, chat: protocol.ChatRequest) -> dict:
    """The response's fields that echo the request's settings (the same in every event of a stream)."""
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) \
        if req.text is not None and req.text.format is not None else {"type": "text"}
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice) \
        else req.tool_choice or "auto"
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": chat.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": chat.temperature,
            "text": {"format": text_format}, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()], "top_p": chat.top_p,
            "truncation": "disabled", "metadata": req.metadata or {}, "user": chat.user}


def _output_text(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
